"""The event loop: receive, admit (grammar manager), schedule, forward, mask and sample, accept, send."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import msgspec
import torch

from scheduler.grammar_manager import GrammarManager
from scheduler.io_struct import (
    AbortReq,
    GenerateOutput,
    GenerateReq,
    PingReq,
    Pong,
    ServerMessage,
    Usage,
    decode_client_message,
    error_output,
    read_rid,
)
from scheduler.ipc import SchedulerIPC
from scheduler.model_runner import ModelRunner
from scheduler.output_text import OutputText
from scheduler.rank_sync import RankSync
from scheduler.request import Req
from scheduler.sampler import sample
from scheduler.sampling_batch_info import SamplingBatchInfo
from scheduler.server_args import ServerArgs
from sglang_constrained.base_grammar_backend import TokenRejectedError, create_grammar_backend
from sglang_constrained.reasoner_grammar_backend import think_end_token_id

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
"""Longest the idle loop sleeps before it looks at its stop flag again."""


class Scheduler:
    """Serves generate requests on one model with continuous batching and grammar-constrained sampling."""

    def __init__(self, server_args: ServerArgs, model_runner: ModelRunner, rank_sync: RankSync | None = None) -> None:
        self.server_args = server_args
        self.model_runner = model_runner
        self.tokenizer = model_runner.tokenizer
        grammar_backend = create_grammar_backend(
            server_args,
            self.tokenizer,
            model_runner.vocab_size,
            model_runner.eos_token_ids,
            think_end_id=think_end_token_id(self.tokenizer, server_args.reasoning_parser),
        )
        self.grammar_manager = GrammarManager(grammar_backend, server_args.compile_timeout_s, rank_sync)
        self.sampling_info = SamplingBatchInfo(
            model_runner.vocab_size, server_args.max_running_requests, model_runner.device
        )
        if grammar_backend is not None:
            self.sampling_info.warm_up()
        self.generator = torch.Generator().manual_seed(server_args.seed)
        self.waiting_queue: deque[Req] = deque()
        self.running: list[Req] = []
        self.live: dict[str, Req] = {}
        self.texts: dict[str, OutputText] = {}
        self.outbox: list[tuple[bytes, ServerMessage]] = []
        self.is_stopping = False
        self.ipc: SchedulerIPC | None = None

    def serve(self, ipc: SchedulerIPC) -> None:
        """Run the loop on ``ipc`` until ``stop()``."""
        self.ipc = ipc
        ipc.watch(self.grammar_manager.wakeup_fd)
        logger.info("scheduler ready on %s (grammar backend: %s)", ipc.endpoint, self.server_args.grammar_backend)
        while not self.is_stopping:
            self.step(ipc.receive(self._wait_time()))
            self._flush_outbox(ipc)

    def _flush_outbox(self, ipc: SchedulerIPC) -> None:
        for client_id, message in self.outbox:
            ipc.send(client_id, message)
        self.outbox.clear()

    def stop(self) -> None:
        self.is_stopping = True

    def shutdown(self) -> None:
        """Answer every live request with an abort, then release the grammar backend's threads."""
        for rid in list(self.live):
            self.live[rid].abort("the server is shutting down")
            self._finish(self.live[rid])
        if self.ipc is not None:
            self._flush_outbox(self.ipc)
        if self.grammar_manager.grammar_backend is not None:
            self.grammar_manager.grammar_backend.shutdown()
        self.grammar_manager.close()

    def step(self, messages: list[tuple[bytes, bytes]]) -> None:
        """One loop turn: handle messages, admit ready grammars, run one prefill and one decode batch."""
        for client_id, payload in messages:
            self.handle_message(client_id, payload)
        for req in self.grammar_manager.get_ready_grammar_requests():
            self._admit(req)
        prefill_batch = self._schedule_prefill()
        decode_batch = [req for req in self.running if req not in prefill_batch]
        if prefill_batch:
            self.running.extend(prefill_batch)
            self._run_batch(prefill_batch, self._prefill)
        if decode_batch:
            self._run_batch(decode_batch, self._decode)

    def _prefill(self, batch: list[Req]) -> torch.Tensor:
        return self.model_runner.prefill([self._slot(req) for req in batch], [req.prompt_ids for req in batch])

    def _decode(self, batch: list[Req]) -> torch.Tensor:
        return self.model_runner.decode([self._slot(req) for req in batch], [req.output_ids[-1] for req in batch])

    def _run_batch(self, batch: list[Req], forward: Callable[[list[Req]], torch.Tensor]) -> None:
        """Forward, mask, sample and accept; an internal failure aborts this batch's requests, not the server."""
        try:
            with torch.inference_mode():
                self._sample_and_process(batch, forward(batch))
        except Exception as e:
            logger.exception("a batch of %d requests failed", len(batch))
            for req in batch:
                if not req.finished:
                    req.abort(f"internal error while generating: {type(e).__name__}: {e}")
                    self._finish(req)

    def handle_message(self, client_id: bytes, payload: bytes) -> None:
        """Act on one client message; whatever goes wrong is answered to that client and logged."""
        try:
            self._handle_message(client_id, payload)
        except Exception as e:
            logger.exception("failed to handle a message from client %s", client_id.hex())
            rid = read_rid(payload)
            if rid is not None:
                self.live.pop(rid, None)
                self.texts.pop(rid, None)
                self.outbox.append((client_id, error_output(rid, f"internal error: {type(e).__name__}: {e}")))

    def _handle_message(self, client_id: bytes, payload: bytes) -> None:
        try:
            message = decode_client_message(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            rid = read_rid(payload)
            logger.warning("malformed message from client %s (rid %s): %s", client_id.hex(), rid, e)
            if rid is not None:
                self.outbox.append((client_id, error_output(rid, f"malformed request: {e}")))
            return
        if isinstance(message, GenerateReq):
            self._add_request(client_id, message)
        elif isinstance(message, AbortReq):
            self.abort_request(message.rid)
        elif isinstance(message, PingReq):
            self.outbox.append((client_id, self._pong()))

    def abort_request(self, rid: str) -> None:
        req = self.live.get(rid)
        if req is None:
            return
        self.grammar_manager.abort_requests({rid})
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
        req.abort("aborted by the client")
        self._finish(req)

    @property
    def num_live_requests(self) -> int:
        return len(self.live)

    def _add_request(self, client_id: bytes, message: GenerateReq) -> None:
        if message.rid in self.live:
            self.outbox.append((client_id, error_output(message.rid, f"a request with rid {message.rid!r} is running")))
            return
        try:
            params = message.sampling_params
            params.validate()
            grammar_key = params.grammar_key()
            messages = [msgspec.structs.asdict(m) for m in message.messages] if message.messages is not None else None
            prompt_ids = self.model_runner.encode_prompt(message.text, messages, message.input_ids)
        except ValueError as e:
            self.outbox.append((client_id, error_output(message.rid, str(e))))
            return
        req = Req(
            rid=message.rid,
            client_id=client_id,
            prompt_ids=prompt_ids,
            sampling_params=params,
            stream=message.stream,
            grammar_key=grammar_key,
            generator=None if params.seed is None else torch.Generator().manual_seed(params.seed),
        )
        self.live[req.rid] = req
        self.texts[req.rid] = OutputText(self.tokenizer, params.stop, needs_live_text=message.stream)
        if not self.grammar_manager.process_req_with_grammar(req):
            self._admit(req)

    def _admit(self, req: Req) -> None:
        """A request whose grammar is settled: queue it for prefill, or answer its failure."""
        if req.finished:
            self._finish(req)
        else:
            self.waiting_queue.append(req)

    def _schedule_prefill(self) -> list[Req]:
        batch: list[Req] = []
        while self.waiting_queue and self.model_runner.num_free_slots > len(batch):
            batch.append(self.waiting_queue.popleft())
        for req in batch:
            req.slot = self.model_runner.allocate_slot()
        return batch

    def _sample_and_process(self, batch: list[Req], logits: torch.Tensor) -> None:
        info = self.sampling_info
        info.prepare(batch)
        info.update_regex_vocab_mask()
        info.apply_logits_bias(logits)
        for row, (req, token) in enumerate(zip(batch, sample(logits, info, self.generator), strict=True)):
            if row in info.fill_errors:
                req.abort(f"the grammar failed to compute the next-token mask: {info.fill_errors[row]}")
            elif token is None:
                req.abort("the grammar allows no token here: the constraint cannot be completed")
            else:
                self._accept(req, token)
            if req.finished:
                self._finish(req)
            elif req.stream:
                self._send_progress(req)

    def _accept(self, req: Req, token: int) -> None:
        req.output_ids.append(token)
        grammar = req.ready_grammar
        if grammar is not None and not grammar.is_terminated():
            kind = req.grammar_key[0] if req.grammar_key else "request's"
            try:
                grammar.accept_token(token)
            except TokenRejectedError as e:
                req.abort(f"token {token} ({self.tokenizer.decode([token])!r}) was rejected by the {kind} grammar: {e}")
                return
            except Exception as e:  # an engine failure must not take the other requests down
                logger.exception("request %s: the %s grammar failed on token %d", req.rid, kind, token)
                req.abort(f"the {kind} grammar failed on token {token}: {e}")
                return
        text = self.texts[req.rid]
        text.update(req.output_ids)
        params = req.sampling_params
        if token in self.model_runner.eos_token_ids or (grammar is not None and grammar.is_terminated()):
            req.finish("stop", matched=token)
        elif text.matched_stop is not None:
            req.finish("stop", matched=text.matched_stop)
        elif len(req.output_ids) >= params.max_new_tokens:
            req.finish("length")
        elif len(req.prompt_ids) + len(req.output_ids) >= self.model_runner.max_seq_len:
            req.finish("length", message=f"reached the context limit of {self.model_runner.max_seq_len} tokens")

    def _finish(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.slot is not None:
            self.model_runner.free_slot(req.slot)
            req.slot = None
        text = self.texts.pop(req.rid, None)
        self.live.pop(req.rid, None)
        grammar = req.ready_grammar
        if grammar is not None:
            grammar.finished = True
        self._send(req, text.final_text(req.output_ids) if text is not None else "", finished=True)

    def _send_progress(self, req: Req) -> None:
        if len(req.output_ids) > req.num_sent_tokens:
            self._send(req, self.texts[req.rid].stable_text(), finished=False)

    def _send(self, req: Req, full_text: str, finished: bool) -> None:
        if req.stream:
            token_ids = req.output_ids[req.num_sent_tokens :]
            text = full_text[len(req.sent_text) :] if full_text.startswith(req.sent_text) else full_text
        else:
            token_ids, text = req.output_ids, full_text
        req.num_sent_tokens = len(req.output_ids)
        req.sent_text = full_text
        output = GenerateOutput(
            rid=req.rid,
            token_ids=token_ids,
            text=text,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            usage=Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=len(req.output_ids)),
            grammar_cache_hit=req.grammar_cache_hit,
        )
        self.outbox.append((req.client_id, output))

    def _slot(self, req: Req) -> int:
        assert req.slot is not None, f"request {req.rid} is scheduled without a KV-cache slot"
        return req.slot

    def _wait_time(self) -> float | None:
        """How long the next receive may block: not at all while there is work, else until a wake-up."""
        if self.running or self.waiting_queue or self.outbox:
            return 0.0
        deadline = self.grammar_manager.time_to_next_deadline()
        if deadline is not None:
            return min(deadline, self.server_args.poll_interval_s)
        return IDLE_WAIT_S

    def _pong(self) -> Pong:
        return Pong(
            model=self.server_args.model_name,
            grammar_backend=self.server_args.grammar_backend,
            vocab_size=self.model_runner.vocab_size,
            num_running_requests=len(self.running),
            num_waiting_requests=len(self.waiting_queue),
            num_compiling_requests=len(self.grammar_manager.grammar_queue),
            num_free_slots=self.model_runner.num_free_slots,
        )
