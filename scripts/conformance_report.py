"""Conformance figures per backend and tokenizer over MaskBench: the same checks the conformance tests run.

    python scripts/conformance_report.py                    # the suite's cases (tests/data/maskbench)
    python scripts/conformance_report.py --data ../shared/data/jsonschemabench/maskbench --limit 200

Prints, per backend and tokenizer: schemas compiled / total, valid instances fully accepted / total and invalid
instances rejected / total (over compiled schemas), and writes the details to results/conformance.json.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scheduler.server_args import ServerArgs
from sglang_constrained.base_grammar_backend import create_grammar_backend
from sglang_constrained.conformance import check_constraint
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.maskbench import iter_case_paths, load_case
from sglang_constrained.tokenizer_loading import TOKENIZER_SETUPS, load_tokenizer_setup

REPO_ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("xgrammar", "llguidance", "outlines")


@dataclass
class Totals:
    backend: str
    tokenizer: str
    num_schemas: int = 0
    num_compiled: int = 0
    num_valid: int = 0
    num_valid_accepted: int = 0
    num_invalid: int = 0
    num_invalid_rejected: int = 0
    seconds: float = 0.0
    wrongly_rejected_cases: list[str] = field(default_factory=list)
    wrongly_accepted_cases: list[str] = field(default_factory=list)


def run(backend_name: str, tokenizer_name: str, paths: list[Path], cache_dir: Path) -> Totals:
    setup = load_tokenizer_setup(tokenizer_name, cache_dir)
    args = ServerArgs(grammar_backend=backend_name)
    backend = create_grammar_backend(args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    assert backend is not None
    totals = Totals(backend_name, tokenizer_name)
    start = time.perf_counter()
    for path in paths:
        case = load_case(path)
        key = make_grammar_key("json", case.schema)
        result = check_constraint(backend, setup, case.name, key, case.valid_instances, case.invalid_instances)
        backend.discard_pending(key)
        totals.num_schemas += 1
        if not result.compiled:
            continue
        totals.num_compiled += 1
        totals.num_valid += result.num_valid
        totals.num_valid_accepted += result.num_valid_accepted
        totals.num_invalid += result.num_invalid
        totals.num_invalid_rejected += result.num_invalid_rejected
        if result.wrongly_rejected:
            totals.wrongly_rejected_cases.append(case.name)
        if result.wrongly_accepted:
            totals.wrongly_accepted_cases.append(case.name)
    totals.seconds = time.perf_counter() - start
    backend.shutdown()
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO_ROOT / "tests" / "data" / "maskbench")
    parser.add_argument("--limit", type=int, default=None, help="at most this many schemas per folder")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    parser.add_argument("--tokenizers", nargs="+", default=list(TOKENIZER_SETUPS))
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "conformance.json")
    options = parser.parse_args()
    folders = sorted(p.name for p in options.data.iterdir() if p.is_dir())
    paths = [p for folder in folders for p in iter_case_paths(options.data, folder, options.limit)]
    print(f"{len(paths)} schemas from {options.data} ({', '.join(folders)})")
    header = ("backend", "tokenizer", "compiled", "valid accepted", "invalid rejected", "time")
    print("{:<11} {:<9} {:>13} {:>16} {:>18} {:>7}".format(*header))
    report = []
    for tokenizer_name in options.tokenizers:
        for backend_name in options.backends:
            t = run(backend_name, tokenizer_name, paths, ServerArgs().cache_path)
            report.append(asdict(t))
            print(
                f"{t.backend:<11} {t.tokenizer:<9} {t.num_compiled:>6}/{t.num_schemas:<6} "
                f"{t.num_valid_accepted:>8}/{t.num_valid:<7} {t.num_invalid_rejected:>9}/{t.num_invalid:<8} "
                f"{t.seconds:>6.0f}s",
                flush=True,
            )
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps(report, indent=2))
    print(f"details: {options.output}")


if __name__ == "__main__":
    main()
