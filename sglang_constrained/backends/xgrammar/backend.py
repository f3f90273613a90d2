"""The xgrammar backend: JSON schemas, regexes, EBNF grammars and structural tags compiled by xgrammar 0.2.8.

xgrammar builds its token masks over our ``TokenizerVocabulary``, whose special and padding entries are blank,
so no special token is ever allowed; the model's EOS ids are the stop tokens, allowed where the grammar can end.
Every grammar's terminals are limited to well-formed UTF-8 before it is compiled (``xgrammar_utf8``).
Masks are int32 bitmasks in the contract's layout; applying them is left to ``triton_ops`` (xgrammar's own CPU
apply kernel is several times slower on this machine).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from collections.abc import Callable
from typing import Any

import pydantic
import xgrammar
from xgrammar.structural_tag import StructuralTag

from sglang_constrained.backends.base import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarBackendArgs,
)
from sglang_constrained.backends.xgrammar.export_cost import GrammarMeasure, refuse_costly_export
from sglang_constrained.backends.xgrammar.fork_server import XGRAMMAR_COMPILE_PRELOAD
from sglang_constrained.backends.xgrammar.grammar import XGrammarGrammar, xgrammar_message
from sglang_constrained.backends.xgrammar.json_whitespace import compact_json_schema_ebnf, json_schema_ebnf
from sglang_constrained.backends.xgrammar.schema_rules import (
    XGRAMMAR_UNSUPPORTED_SCHEMA_FEATURES,
    refuse_predicted_beyond_deadline,
    schema_object_sizes,
    schema_patterns,
)
from sglang_constrained.backends.xgrammar.utf8 import check_grammar_format, well_formed_utf8_grammar
from sglang_constrained.cache.compiled import GrammarExport
from sglang_constrained.cache.identity import engine_version
from sglang_constrained.cache.vocabulary import TokenizerVocabulary, tokenizer_vocabulary, vocabulary_fingerprint
from sglang_constrained.compile.control import CompileControl
from sglang_constrained.compile.processes import CompileProcesses, why_processes_cannot_start
from sglang_constrained.constraint_spec import GrammarKey, check_schema_is_valid
from sglang_constrained.errors import GrammarSpecError, bounded_message
from sglang_constrained.schema.features import iter_subschemas, one_of_overlap_rule, refuse_unsupported_features
from sglang_constrained.schema.lark import is_lark_grammar, lark_to_gbnf
from sglang_constrained.schema.strict_mode import allow_unlisted_properties, strict_mode_narrowing

logger = logging.getLogger(__name__)

JSON_SCHEMA = "JSON schema"
STRUCTURAL_TAG = "structural tag"
EBNF_GRAMMAR = "EBNF grammar"


class XGrammarGrammarBackend(BaseGrammarBackend):
    """Compiles constraints with xgrammar ``GrammarCompiler``s over the tokenizer's vocabulary.

    Building the vocabulary decodes every token (seconds at 248k tokens). Compiles run in
    ``CompileProcesses`` (a compile can take xgrammar seconds to minutes): at low priority, on one thread each, so
    the compile service's slots bound the cores they take, and killed at the compile deadline, past the memory
    bound or when cancelled. The compiled grammar comes back serialised. Where no process can be started
    (``why_processes_cannot_start``) compiles run in threads, with a warning. xgrammar's own compile cache is
    off; the pipeline around the backend caches with a bound. With ``require_exact`` objects are compiled with
    JSON Schema's default (unlisted properties allowed) written out, and arrays strict mode would close are refused.
    """

    name = "xgrammar"

    def __init__(
        self,
        server_args: GrammarBackendArgs,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        vocabulary: TokenizerVocabulary | None = None,
        compile_in_processes: bool = True,
    ) -> None:
        """``vocabulary``: the tokenizer's, already built (a compile process gets it so, and no tokenizer);
        ``compile_in_processes=False`` compiles on the compile service's threads (what a compile process does). A
        subclass always does: a compile process runs this class's code, and the subclass's overrides must run."""
        if server_args.constrained_json_whitespace_pattern is not None:
            raise ValueError(
                "the xgrammar grammar backend cannot restrict JSON whitespace to a regex "
                "(--constrained-json-whitespace-pattern); use --constrained-json-disable-any-whitespace for "
                "compact JSON instead, or leave both unset for the default (a line break, then up to 20 spaces or tabs)"
            )
        check_grammar_format()
        super().__init__(server_args, vocab_size)
        self.vocabulary = vocabulary or tokenizer_vocabulary(
            tokenizer, vocab_size, eos_token_ids, server_args.vocabulary_cache_path
        )
        self.tokenizer_info = xgrammar.TokenizerInfo.from_vocab_and_metadata(
            list(self.vocabulary.decoded_vocab), self.vocabulary.xgrammar_metadata
        )
        # xgrammar's default is 8 threads per compile, whatever the machine: one, so that a compile takes one core.
        self.compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)
        self.is_compact_json = server_args.constrained_json_disable_any_whitespace
        self.compile_processes: CompileProcesses[tuple[GrammarKey, bool, bool], GrammarExport] | None = None
        if compile_in_processes and type(self) is XGrammarGrammarBackend:
            reason = why_processes_cannot_start()
            if reason is not None:
                logger.warning(
                    "xgrammar compiles in threads, not in compile processes, because %s: a compile past its "
                    "deadline then runs on to its end",
                    reason,
                )
            else:
                self.compile_processes = CompileProcesses(
                    functools.partial(_start_compile_process, server_args, self.vocabulary),
                    name=self.name,
                    timeout_s=server_args.compile_timeout_s,
                    # one more than the slots: when a compile is killed, the next one's child has already started
                    num_spares=server_args.grammar_compile_threads + 1,
                    max_memory_mib=server_args.grammar_compile_max_memory,
                    preload=XGRAMMAR_COMPILE_PRELOAD,
                )

    def build_grammar(self, key: GrammarKey, control: CompileControl | None = None) -> BaseGrammarObject:
        """Compile ``key`` in a compile process (here, in one); raises ``CompileTimeoutError`` past the deadline and
        ``CompileProcessError`` if xgrammar crashed, the process grew past its memory bound or was stopped."""
        if self.compile_processes is None:
            return super().build_grammar(key, control)
        return self.build_exportable(key, control)[0]

    def build_exportable(
        self, key: GrammarKey, control: CompileControl | None = None
    ) -> tuple[BaseGrammarObject, Callable[[], GrammarExport]]:
        """Keeps the export a compile process sent back: serialising again can cost several times the compile."""
        if self.compile_processes is None:
            return super().build_exportable(key, control)
        export = self.compile_processes.run((key, self.require_exact, self.closes_open_schemas), control)
        return self.import_grammar(export), lambda: export

    @property
    def can_share_grammars(self) -> bool:
        return True

    def compile_identity(self) -> dict[str, Any]:
        return {**super().compile_identity(), "engine": engine_version("xgrammar"), "tokenizer": self._fingerprint}

    @functools.cached_property
    def _fingerprint(self) -> str:
        return vocabulary_fingerprint(self.vocabulary)

    def serialize_grammar(self, grammar: BaseGrammarObject) -> str:
        """xgrammar's ``CompiledGrammar.serialize_json``: the compiled grammar, token masks included."""
        if not isinstance(grammar, XGrammarGrammar):
            raise TypeError(f"not an xgrammar grammar: {type(grammar).__name__}")
        return grammar.compiled_grammar.serialize_json()

    def deserialize_grammar(self, payload: bytes | str) -> XGrammarGrammar:
        text = payload.decode() if isinstance(payload, bytes) else payload
        compiled = xgrammar.CompiledGrammar.deserialize_json(text, self.tokenizer_info)
        return XGrammarGrammar(compiled, self.vocabulary.stop_token_ids, self.vocabulary.decoded_vocab)

    def wait_until_ready(self) -> None:
        if self.compile_processes is not None:
            self.compile_processes.wait_until_ready()

    def shutdown(self) -> None:
        if self.compile_processes is not None:
            self.compile_processes.shutdown()
        super().shutdown()

    def check_json_schema(self, schema: dict[str, Any] | bool) -> None:
        schema = copy.deepcopy(schema)
        for _, subschema in iter_subschemas(schema):  # property names are strings, whether or not it is said
            names = subschema.get("propertyNames")
            if isinstance(names, dict) and "type" not in names:
                subschema["propertyNames"] = {"type": "string", **names}
        rules = (*XGRAMMAR_UNSUPPORTED_SCHEMA_FEATURES, one_of_overlap_rule(schema))
        refuse_unsupported_features(schema, rules, self.name)

    def json_schema_narrowing(self, schema: Any) -> str | None:
        return strict_mode_narrowing(schema, objects=not self.require_exact)

    def prepare_json_schema(self, schema: Any, originals: dict[str, str] | None = None) -> Any:
        prepared = _length_bounds_as_patterns(super().prepare_json_schema(schema, originals))
        deadline_s, object_sizes = self.server_args.compile_timeout_s, schema_object_sizes(prepared)
        refuse_predicted_beyond_deadline(schema_patterns(prepared), object_sizes, self.vocab_size, deadline_s, "schema")
        return allow_unlisted_properties(prepared) if self.require_exact else prepared

    def dispatch_json(self, key_string: str) -> XGrammarGrammar:
        return self._compile(JSON_SCHEMA, lambda: self.json_schema_grammar(key_string))

    def json_schema_grammar(self, key_string: str) -> xgrammar.Grammar:
        """xgrammar's grammar for a prepared schema, as xgrammar makes it (``_compile`` then limits it to UTF-8).

        xgrammar's strict mode, as SGLang: objects hold only the properties the schema lists. Every output still
        validates against the schema; the model just cannot invent keys (which would also make it likelier to run
        out of tokens before closing the object). Non-strict mode would accept the 18 valid Github_trivial instances
        that have unlisted properties, but makes compiles up to hundreds of times slower at 248k tokens
        (docs/benchmarks.md).
        """
        if not self.is_compact_json:  # the default whitespace (``xgrammar_json_whitespace``)
            return _from_ebnf(json_schema_ebnf(key_string))
        return xgrammar.Grammar.from_json_schema(
            key_string, any_whitespace=False, separators=(",", ":"), strict_mode=True
        )

    def dispatch_regex(self, key_string: str) -> XGrammarGrammar:
        deadline_s = self.server_args.compile_timeout_s
        refuse_predicted_beyond_deadline([key_string], [], self.vocab_size, deadline_s, "regex")
        return self._compile("regex", lambda: xgrammar.Grammar.from_regex(key_string))

    def dispatch_ebnf(self, key_string: str) -> XGrammarGrammar:
        return self._compile(EBNF_GRAMMAR, lambda: self.ebnf_grammar(key_string))

    def ebnf_grammar(self, key_string: str) -> xgrammar.Grammar:
        """xgrammar's grammar for GBNF (root rule ``root``), or for Lark (rule ``start``) written as GBNF first
        (``lark_grammar``)."""
        return _from_ebnf(self._gbnf(key_string))

    def takes_as_written(self, key: GrammarKey) -> bool:
        return key[0] == "structural_tag" or (key[0] == "ebnf" and not is_lark_grammar(key[1]))

    def _gbnf(self, grammar: str) -> str:
        return lark_to_gbnf(grammar, self.name) if is_lark_grammar(grammar) else grammar

    def dispatch_structural_tag(self, key_string: str) -> XGrammarGrammar:
        return self._compile(STRUCTURAL_TAG, lambda: self.structural_tag_grammar(key_string))

    def structural_tag_grammar(self, key_string: str) -> xgrammar.Grammar:
        """xgrammar's grammar for a structural tag: xgrammar's ``{"type": "structural_tag", "format": ...}`` or the
        legacy ``structures`` form, its JSON schemas prepared as a request's own (``_prepared_tag``)."""
        spec = _new_form_structural_tag(json.loads(key_string))
        try:
            StructuralTag.model_validate(spec)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise GrammarSpecError(f"invalid structural tag at {where}: {bounded_message(first['msg'])}") from e
        prepared = StructuralTag.model_validate({**spec, "format": self._prepared_tag(spec["format"], "/format")})
        return xgrammar.Grammar.from_structural_tag(prepared)

    def _compile(self, what: str, build: Callable[[], xgrammar.Grammar]) -> XGrammarGrammar:
        """Build the grammar, limit its terminals to well-formed UTF-8 (``xgrammar_utf8``), compile it, and refuse it
        if sending its compiled form out of a compile process is predicted beyond the memory bound or the deadline
        (``xgrammar_export_cost``): a JSON schema's before its compile, any other after it, before it is serialised
        (xgrammar's compile merges a structural tag's or an EBNF grammar's rules, a 100-tool tag's 4,403 into
        1,124, so only the compiled grammar's measure predicts their size; a schema's barely changes)."""
        args = self.server_args
        try:
            grammar = well_formed_utf8_grammar(build())
            if what == JSON_SCHEMA:
                measure = GrammarMeasure.of(grammar)
                refuse_costly_export(measure, args.grammar_compile_max_memory, args.compile_timeout_s, what)
            compiled = self.compiler.compile_grammar(grammar)
            if what != JSON_SCHEMA and (measure_compiled := GrammarMeasure.of_compiled(compiled)) is not None:
                max_memory_mib, deadline_s = args.grammar_compile_max_memory, args.compile_timeout_s
                refuse_costly_export(measure_compiled, max_memory_mib, deadline_s, what, compiled=True)
        except RuntimeError as e:
            raise GrammarSpecError(f"xgrammar cannot compile the {what}: {xgrammar_message(e)}") from e
        return XGrammarGrammar(compiled, self.vocabulary.stop_token_ids, self.vocabulary.decoded_vocab)

    def _prepared_tag(self, node: Any, pointer: str) -> Any:
        """The structural tag's ``node`` with its JSON schemas prepared as a request's own, its token ids vetted."""
        if isinstance(node, list):
            return [self._prepared_tag(item, f"{pointer}/{index}") for index, item in enumerate(node)]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "grammar" and isinstance(node.get("grammar"), str):
            return {**node, "grammar": self._gbnf(node["grammar"])}
        if node.get("type") == "json_schema":
            try:
                check_schema_is_valid(node.get("json_schema"))
                schema = self.prepare_json_schema(node["json_schema"])
            except GrammarSpecError as e:
                raise GrammarSpecError(f"in the structural tag's JSON schema at {pointer}: {e}") from e
            is_plain_json = set(node) <= {"type", "json_schema", "style"} and node.get("style") in (None, "json")
            if is_plain_json:  # the server's JSON whitespace, as a grammar of its own (the tag's JSON has none)
                ebnf = compact_json_schema_ebnf if self.is_compact_json else json_schema_ebnf
                return {"type": "grammar", "grammar": ebnf(json.dumps(schema))}
            return {**node, "json_schema": schema}
        token, decoded = node.get("token") if node.get("type") == "token" else None, self.vocabulary.decoded_vocab
        if isinstance(token, int) and (not 0 <= token < len(decoded) or decoded[token] == b""):  # blank: special
            raise GrammarSpecError(
                f"the structural tag requires token {token} at {pointer}, which is not a regular token "
                "(special, padding or out of range) and so is never allowed"
            )
        return {key: self._prepared_tag(value, f"{pointer}/{key}") for key, value in node.items()}


def _from_ebnf(ebnf: str) -> xgrammar.Grammar:
    return xgrammar.Grammar.from_ebnf(ebnf, root_rule_name="root")


def _start_compile_process(
    server_args: GrammarBackendArgs, vocabulary: TokenizerVocabulary
) -> Callable[[tuple[GrammarKey, bool, bool]], GrammarExport]:
    """The compile function of a compile process: the same checks and compile as the server's (asked for with the
    server backend's ``require_exact`` and ``closes_open_schemas``), on its own thread; the result comes back
    exported (serialised)."""
    backend = XGrammarGrammarBackend(
        server_args,
        None,
        vocabulary.model_vocab_size,
        list(vocabulary.stop_token_ids),
        vocabulary=vocabulary,
        compile_in_processes=False,
    )

    def compile_key(request: tuple[GrammarKey, bool, bool]) -> GrammarExport:
        key, backend.require_exact, backend.closes_open_schemas = request
        return backend.export_grammar(backend.build_grammar(key))

    return compile_key


_JSON_STRING_CHARACTER = '[^"\\\\\\u0000-\\u001f]'


def _length_bounds_as_patterns(schema: Any) -> Any:
    """``schema`` (a private copy) with each ``minLength``/``maxLength`` string written as a pattern, in place.

    xgrammar 0.2.8 gives a length-bounded string a character class that lets control characters through raw,
    which is not JSON (``tests/backends/test_engine_faults.py`` keeps the reproduction); its patterns are sound.
    Like xgrammar's own, the pattern's characters are written without escapes.
    """
    for _, subschema in iter_subschemas(schema):
        if ("minLength" in subschema or "maxLength" in subschema) and "pattern" not in subschema:
            low, high = subschema.pop("minLength", 0), subschema.pop("maxLength", "")
            subschema["pattern"] = f"^{_JSON_STRING_CHARACTER}{{{low},{high}}}$"
    return schema


def _new_form_structural_tag(spec: dict[str, Any]) -> dict[str, Any]:
    """The structural tag as xgrammar's ``StructuralTag`` JSON, converting the legacy ``structures`` form."""
    if spec.get("type", "structural_tag") != "structural_tag":
        raise GrammarSpecError(f"a structural tag has type 'structural_tag', not {str(spec['type'])[:60]!r}")
    if "format" in spec:
        return spec
    if "structures" not in spec or "triggers" not in spec:
        raise GrammarSpecError(
            "a structural tag needs 'format' (xgrammar's structural tag) or 'structures' and 'triggers' "
            "(the legacy form)"
        )
    structures = spec["structures"]
    if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
        raise GrammarSpecError("the structural tag's 'structures' must be a list of objects")
    tags = []
    for index, structure in enumerate(structures):
        missing = [field for field in ("begin", "schema", "end") if field not in structure]
        if missing:
            raise GrammarSpecError(f"structural tag structure {index} lacks {', '.join(missing)}")
        content = {"type": "json_schema", "json_schema": structure["schema"]}
        tags.append({"type": "tag", "begin": structure["begin"], "content": content, "end": structure["end"]})
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": spec["triggers"], "tags": tags},
    }
