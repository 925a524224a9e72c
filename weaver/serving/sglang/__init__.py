"""SGLang plugin: registers the tree methods as SGLang speculative algorithms.

`register` is the entry point SGLang calls in every process it starts (group `sglang.srt.plugins`,
declared in pyproject.toml), so `--speculative-algorithm WEAVER` resolves to ours. What exists and what
does not is in the README ("Serving with SGLang").
"""

from __future__ import annotations

ALGORITHMS = ("WEAVER", "DDTREE")  # the adapter's search; the same search scoring by the drafter's marginals

WORKER_MISSING = (
    "{name} is registered with SGLang by the weaver plugin, but its SGLang worker (drafting, tree verify and "
    "commit inside SGLang's scheduler) is not built yet; run it with weaver's own engine (`python eval.py`, "
    "`benchmarks/spec_decode.py`). See the README, 'Serving with SGLang'."
)


def register() -> None:
    """Register every algorithm in ALGORITHMS with SGLang (idempotent: SGLang may call plugins again)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    for name in ALGORITHMS:
        try:
            SpeculativeAlgorithm.from_string(name)
            continue  # already registered in this process
        except ValueError:
            pass
        SpeculativeAlgorithm.register(name, validate_server_args=_refuse(name))(_refuse(name))


def _refuse(name: str):
    """Server-args check and worker factory in one: stop the launch with the reason, before any model loads."""

    def refuse(server_args) -> None:
        raise NotImplementedError(WORKER_MISSING.format(name=name))

    return refuse
