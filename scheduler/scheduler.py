"""The event loop: receive, admit (grammar manager), schedule, forward, mask and sample, accept, send."""

from __future__ import annotations

import logging
from collections import deque

import msgspec
import torch

from scheduler.batch_executor import BatchExecutor
from scheduler.budget_steering import BudgetSteering
from scheduler.data_parallel import DataParallelReplica
from scheduler.distributed import DistributedContext
from scheduler.finish_policy import FinishPolicy
from scheduler.grammar_manager import GrammarManager
from scheduler.io_struct import (
    MAX_TOP_LOGPROBS,
    AbortCause,
    AbortReq,
    FlushCacheDone,
    FlushCacheReq,
    GenerateReq,
    PingReq,
    Pong,
    ReplicaStatus,
    decode_client_message,
    error_output,
    read_rid,
)
from scheduler.ipc import SchedulerIPC
from scheduler.model.runner_contract import BaseModelRunner
from scheduler.ngram_cache import NgramCache
from scheduler.output_messages import next_output
from scheduler.output_text import OutputText
from scheduler.predicted_output import PredictionAligner
from scheduler.prefill_admission import PrefillAdmission
from scheduler.prompt_encoder import PromptEncoder
from scheduler.reasoning_gate import ReasoningGate
from scheduler.request import CLIENT_ABORT, Abort, Req
from scheduler.sampling_batch_info import SamplingBatchInfo
from scheduler.server_args import ServerArgs
from scheduler.speculative import NGRAM_MAX, DraftProposer, resolve_algorithm
from scheduler.turn_transport import LockstepRanks, Messages, OneRank, Outbox, TurnTransport
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.registry import create_grammar_backend
from sglang_constrained.cache.disk import open_grammar_disk_cache
from sglang_constrained.cache.vocabulary import tokenizer_vocabulary
from sglang_constrained.endings.search import EndingSearch
from triton_ops import load_cpu_bitmask_kernel
from triton_ops.bitmask_format import VocabMaskLayout

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
"""Longest the idle loop sleeps before it looks at its stop flag again."""
SHUTDOWN = Abort(AbortCause.SHUTDOWN, "the server is shutting down")
"""Tokens of a prompt's start, computed by a request admitted before it in the same turn, for which a request waits a
turn and takes them from the prefix cache (SGLang's in-batch prefix caching threshold): tools or a long system
prompt sent with many requests at once are computed once."""


class Scheduler:
    """Serves generate requests on one model with continuous batching and grammar-constrained sampling.

    With a ``DistributedContext`` it is one rank of several; how its turns' messages come in and its outputs go out
    is its ``transport``, chosen once here (``choose_turn_transport``), and the loop never asks which. It takes the
    whole ``ServerArgs``: it assembles the grammar backend, the draft proposer, the batch and the transport, each from
    its part, and reads the model part's capacity and the serving part's seed itself.
    """

    def __init__(
        self, server_args: ServerArgs, model_runner: BaseModelRunner, dist: DistributedContext | None = None
    ) -> None:
        self.server_args = server_args
        self.tokenizer = model_runner.tokenizer
        self.prompt_encoder = PromptEncoder(self.tokenizer, model_runner.vocab_size, model_runner.max_seq_len)
        self.vocab_size = model_runner.vocab_size
        self.kv = model_runner.kv
        self.max_seq_len = model_runner.max_seq_len
        self.admission = PrefillAdmission(self.kv, server_args.model.max_running_requests, self.max_seq_len)
        grammar_args, speculation = server_args.grammar, server_args.speculation
        self.reasoning = ReasoningGate(grammar_args, self.tokenizer)
        grammar_backend = self.reasoning.wrap_backend(
            create_grammar_backend(
                grammar_args,
                self.tokenizer,
                model_runner.vocab_size,
                model_runner.eos_token_ids,
                disk_cache=open_grammar_disk_cache(
                    grammar_args.grammar_disk_cache_path, grammar_args.grammar_disk_cache_max_bytes
                ),
            )
        )
        self.transport = choose_turn_transport(dist, grammar_backend, server_args)
        budget = self._budget_steering(model_runner, grammar_backend is not None)
        self.grammar_manager = GrammarManager(grammar_backend, self.transport.rank_sync, budget)
        ngram_cache = None
        if speculation.speculative_ngram_capacity and speculation.speculative_num_draft_tokens:
            ngram_cache = NgramCache(
                speculation.speculative_ngram_capacity, NGRAM_MAX, speculation.speculative_num_draft_tokens
            )
        self.proposer = DraftProposer(
            resolve_algorithm(speculation.speculative_algorithm, server_args.model.model_runner),
            speculation.speculative_num_draft_tokens,
            self.tokenizer,
            model_runner.vocab_size,
            row_multiple=model_runner.row_multiple,
            ngram_cache=ngram_cache,
            tokens_per_forward=model_runner.tokens_per_forward,
            lookup_max_batch=model_runner.lookup_max_batch,
            lookup_row_tile=model_runner.lookup_row_tile,
            max_prediction_tokens=speculation.speculative_num_prediction_tokens,
        )
        mask_layout = grammar_backend.mask_layout if grammar_backend is not None else None
        if mask_layout is None and self.reasoning.enabled:  # free requests that reason are gated by masks too
            mask_layout = VocabMaskLayout(model_runner.vocab_size)
        sampling_info = SamplingBatchInfo(
            model_runner.vocab_size,
            server_args.model.max_running_requests,
            model_runner.device,
            mask_layout,
            max_rows_per_request=1 + speculation.max_drafts_per_request,
            eos_token_ids=model_runner.eos_token_ids,
        )
        if model_runner.device.type == "cpu":  # the mask loop and the sampler's draws; the default runner's model has
            load_cpu_bitmask_kernel(server_args.model.kernel_build_path)  # loaded them already
        if grammar_backend is not None:
            grammar_backend.wait_until_ready()
        self.seed_generator = torch.Generator().manual_seed(server_args.serving.seed)
        self.finish_policy = FinishPolicy(model_runner.eos_token_ids, model_runner.max_seq_len, self.reasoning)
        self.executor = BatchExecutor(
            model_runner, sampling_info, self.proposer, self.finish_policy, self.transport.rank_sync, budget
        )
        self.waiting_queue: deque[Req] = deque()
        self.running: list[Req] = []
        self.live: dict[str, Req] = {}
        self.outbox: Outbox = []
        self.is_stopping = False
        self.num_finished_requests = 0

    def _budget_steering(self, model_runner: BaseModelRunner, has_grammars: bool) -> BudgetSteering | None:
        """Budget-aware constraints, unless switched off or nothing is constrained."""
        if not has_grammars or self.server_args.grammar.disable_budget_aware_constraints:
            return None
        vocabulary = tokenizer_vocabulary(
            self.tokenizer, self.vocab_size, model_runner.eos_token_ids, self.server_args.grammar.vocabulary_cache_path
        )
        return BudgetSteering(
            EndingSearch(vocabulary), self.max_seq_len, lambda: self.grammar_manager.metrics.budget_steered.inc()
        )

    def serve(self, ipc: SchedulerIPC | None) -> None:
        """Run the loop until ``stop()`` on any rank; ``ipc`` is rank 0's socket (None on the other ranks)."""
        if ipc is not None:
            ipc.watch(self.grammar_manager.wakeup_fd)
            logger.info(
                "scheduler ready on %s (grammar backend: %s)", ipc.endpoint, self.server_args.grammar.grammar_backend
            )
        while True:
            messages, should_stop = self.transport.exchange(ipc, self._wait_time(), self._status(), self.is_stopping)
            if should_stop:
                return
            self.step(messages)
            self._flush_outbox(ipc)

    def stop(self) -> None:
        self.is_stopping = True

    def shutdown(self, ipc: SchedulerIPC | None) -> None:
        """Answer every live request with an abort, then release the grammar backend's threads."""
        for req in list(self.live.values()):
            req.abort(SHUTDOWN)
            self._finish(req)
        self._flush_outbox(ipc)
        self.transport.shutdown(ipc, SHUTDOWN.message)
        if self.grammar_manager.grammar_backend is not None:
            self.grammar_manager.grammar_backend.shutdown()
        self.grammar_manager.close()

    def step(self, messages: Messages) -> None:
        """One loop turn: handle messages, admit ready grammars, run one prefill and one decode batch."""
        for client_id, payload in messages:
            self.handle_message(client_id, payload)
        for req in self.grammar_manager.get_ready_grammar_requests():
            self._admit(req)
        prefill_batch = self.admission.schedule(self.waiting_queue, len(self.running))
        decode_batch = list(self.running)
        if prefill_batch:
            self.running.extend(prefill_batch)
            self.executor.prefill(prefill_batch)
            self.admission.share_prefixes(prefill_batch, self.waiting_queue)
            self._after_batch(prefill_batch)
        if decode_batch:
            self.executor.decode(decode_batch)
            self._after_batch(decode_batch)

    def handle_message(self, client_id: bytes, payload: bytes) -> None:
        """Act on one client message; whatever goes wrong is answered to that client and logged."""
        try:
            self._handle_message(client_id, payload)
        except Exception as e:
            logger.exception("failed to handle a message from client %s", client_id.hex())
            rid = read_rid(payload)
            if rid is not None:
                self.live.pop(rid, None)
                message = f"internal error: {type(e).__name__}: {e}"
                self.outbox.append((client_id, error_output(rid, AbortCause.INTERNAL, message)))

    def abort_request(self, rid: str) -> None:
        req = self.live.get(rid)
        if req is None:
            return
        self.grammar_manager.abort_requests({rid})
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
        req.abort(CLIENT_ABORT)
        logger.info("request %s aborted by the client", rid)
        self._finish(req)

    def _handle_message(self, client_id: bytes, payload: bytes) -> None:
        try:
            message = decode_client_message(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            rid = read_rid(payload)
            logger.warning("malformed message from client %s (rid %s): %s", client_id.hex(), rid, e)
            if rid is not None:
                self.outbox.append((client_id, error_output(rid, AbortCause.BAD_REQUEST, f"malformed request: {e}")))
            return
        if isinstance(message, GenerateReq):
            self._add_request(client_id, message)
        elif isinstance(message, AbortReq):
            self.abort_request(message.rid)
        elif isinstance(message, PingReq):
            self.outbox.append((client_id, self._pong(message.ping_id)))
        elif isinstance(message, FlushCacheReq):
            self.outbox.append((client_id, self._flush_cache(message.request_id)))

    def _flush_cache(self, request_id: str) -> FlushCacheDone:
        """Drop the prefix cache, as SGLang's ``/flush_cache`` does: only when no request is live (they read it)."""
        if self.live:
            message = f"not flushed: {len(self.live)} requests are running or waiting"
            return FlushCacheDone(request_id=request_id, success=False, message=message)
        num_rows = self.kv.flush()
        return FlushCacheDone(request_id=request_id, success=True, message=f"flushed {num_rows} cached tokens")

    def _add_request(self, client_id: bytes, message: GenerateReq) -> None:
        if message.rid in self.live:
            running = f"a request with rid {message.rid!r} is running"
            self.outbox.append((client_id, error_output(message.rid, AbortCause.BAD_REQUEST, running)))
            return
        try:
            params = message.sampling_params
            params.validate()
            params.check_token_ids(self.vocab_size)
            if message.top_logprobs_num is not None and not 0 <= message.top_logprobs_num <= MAX_TOP_LOGPROBS:
                raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
            grammar_key = params.grammar_key()
            messages = [msgspec.structs.asdict(m) for m in message.messages] if message.messages is not None else None
            prompt_ids = self.prompt_encoder.encode(
                message.text, messages, message.input_ids, message.chat_template_kwargs
            )
            self.kv.check_fits(len(prompt_ids), self.admission.output_budget(prompt_ids, params.max_new_tokens))
            prediction = None
            if message.prediction is not None:
                prediction = PredictionAligner(self.prompt_encoder.encode_prediction(message.prediction))
        except ValueError as e:
            self.outbox.append((client_id, error_output(message.rid, AbortCause.BAD_REQUEST, str(e))))
            return
        req = Req(
            rid=message.rid,
            client_id=client_id,
            prompt_ids=prompt_ids,
            sampling_params=params,
            stream=message.stream,
            grammar_key=grammar_key,
            sampling_seed=self._sampling_seed(params.seed),
            text=OutputText(
                self.tokenizer,
                params.stop,
                needs_live_text=message.stream,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                no_stop_trim=params.no_stop_trim,
            ),
            top_logprobs_num=message.top_logprobs_num,
            prediction=prediction,
        )
        if message.separate_reasoning and self.reasoning.enabled:
            req.reasoning_text = OutputText(
                self.tokenizer,
                [],
                needs_live_text=message.stream,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        self.live[req.rid] = req
        if not self.grammar_manager.process_req_with_grammar(req):
            self._admit(req)

    def _sampling_seed(self, seed: int | None) -> int:
        """The request's seed, or the server's next draw (the same on every rank: they see the same requests)."""
        drawn = int(torch.randint(0, 2**62, (1,), generator=self.seed_generator))
        return drawn if seed is None else seed

    def _admit(self, req: Req) -> None:
        """A request whose grammar is settled: queue it for prefill, or answer its failure."""
        if req.finished:
            self._finish(req)
        else:
            self.reasoning.attach(req)
            self.waiting_queue.append(req)

    def _after_batch(self, batch: list[Req]) -> None:
        """Finish who finished; stream what is new to the others."""
        for req in batch:
            if req.finished:
                self._finish(req)
            elif req.stream and len(req.output_ids) > req.num_sent_tokens:
                assert req.text is not None
                reasoning = req.reasoning_text.stable_text() if req.reasoning_text is not None else None
                self._send(req, req.text.stable_text(), finished=False, full_reasoning=reasoning)

    def _finish(self, req: Req) -> None:
        self.num_finished_requests += 1
        if req in self.running:
            self.running.remove(req)
        self.proposer.forget(req)  # the n-gram cache takes the rest of its output
        if req.kv is not None:  # its rows go to the prefix cache (or back to the pool)
            self.kv.release(req.kv)
            req.kv = None
        self.live.pop(req.rid, None)
        text, reasoning = self.finish_policy.final_texts(req)
        self._send(req, text, finished=True, full_reasoning=reasoning)

    def _send(self, req: Req, full_text: str, finished: bool, full_reasoning: str | None = None) -> None:
        output = next_output(req, full_text, finished, self.reasoning.num_reasoning_tokens(req), full_reasoning)
        self.outbox.append((req.client_id, output))

    def _flush_outbox(self, ipc: SchedulerIPC | None) -> None:
        self.transport.send(ipc, self.outbox)
        self.outbox.clear()

    def _wait_time(self) -> float | None:
        """How long the next receive may block: not at all while there is work, else until a wake-up."""
        if self.running or self.waiting_queue or self.outbox:
            return 0.0
        if self.grammar_manager.grammar_queue:  # another rank's compile may finish: turn the loop to hear it
            return self.server_args.serving.poll_interval_s
        return IDLE_WAIT_S

    def _status(self) -> ReplicaStatus:
        return ReplicaStatus(
            rank=self.transport.rank,
            num_running_requests=len(self.running),
            num_waiting_requests=len(self.waiting_queue),
            num_compiling_requests=len(self.grammar_manager.grammar_queue),
            num_free_kv_tokens=self.kv.num_available,
            num_finished_requests=self.num_finished_requests,
            num_output_tokens=self.executor.stats.num_output_tokens,
            num_forwards=self.executor.stats.num_forwards,
        )

    def _pong(self, ping_id: str) -> Pong:
        pong = Pong(
            model=self.server_args.model.model_name,
            grammar_backend=self.server_args.grammar.grammar_backend,
            vocab_size=self.vocab_size,
            ping_id=ping_id,
            num_running_requests=len(self.running),
            num_waiting_requests=len(self.waiting_queue),
            num_compiling_requests=len(self.grammar_manager.grammar_queue),
            num_free_kv_tokens=self.kv.num_available,
            cache_hit_rate=self.kv.cache_hit_rate,
            num_forwards=self.executor.stats.num_forwards,
            num_output_tokens=self.executor.stats.num_output_tokens,
            num_forced_tokens=self.executor.stats.num_forced_tokens,
            drafts_proposed=dict(self.executor.stats.drafts_proposed),
            drafts_accepted=dict(self.executor.stats.drafts_accepted),
            draft_runs=dict(self.executor.stats.draft_runs),
            metrics_text=self.grammar_manager.metrics.render(),
        )
        return self.transport.group_pong(pong, self._status())


def choose_turn_transport(
    dist: DistributedContext | None, grammar_backend: GrammarPipeline | None, server_args: ServerArgs
) -> TurnTransport:
    """This rank's transport, by the rank layout: one process, data-parallel replicas (``--dp-size``), or ranks in
    lockstep (every other layout of several ranks). The whole ``server_args``: the layout is the parallel part's, a
    replica's grammar store the grammar part's and its idle wait the serving part's."""
    if dist is None:
        return OneRank()
    if server_args.parallel.dp_size > 1:
        return DataParallelReplica(dist, grammar_backend, server_args.grammar, server_args.serving.poll_interval_s)
    return LockstepRanks(dist, grammar_backend, server_args.grammar)
