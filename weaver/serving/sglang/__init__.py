"""SGLang plugin: registers the tree methods as SGLang speculative algorithms.

`register` is the entry point SGLang calls in every process it starts (group `sglang.srt.plugins`,
declared in pyproject.toml), so `--speculative-algorithm WEAVER` (or DDTREE) resolves to our worker
(`weaver.serving.sglang.worker`, imported only when SGLang builds it). What has run where is in the README
("Serving with SGLang").

Settings: `--speculative-draft-model-path` is our drafter (DFlash format), `--speculative-num-draft-tokens`
the tree size (budget + 1, default 16); the Weaver adapter and the search's children per node come from the
environment (SGLang's argument parser is not ours to extend): WEAVER_ADAPTER=<adapter folder>, WEAVER_CHILDREN,
WEAVER_NODES_PER_CALL, WEAVER_POOL (candidates per depth; default the adapter's own pool), WEAVER_RESCORE (greedy
requests' Weaver trees in one adapter call, `weaver.search.rescore`), WEAVER_RRS_PRIORITY
(draft | acceptance: how sampled requests' trees rank their nodes, `weaver.calibration`; one table per worker
learns from all its requests' steps), WEAVER_SAMPLING (rrs | traversal: the rule that verifies sampled requests'
drawn trees, `weaver.acceptance`; default rrs), WEAVER_FIXED_CHILDREN (sampled requests' trees list each node's that
many most probable children and draw the rest, `eval.fixed_children`; rrs only; default 0), WEAVER_DRAFT_TEMPERATURE
(sampled requests' trees drawn from the draft at this temperature instead of the request's, `eval.draft_temperature`;
lossless for any value), and WEAVER_TRACE=<file>: every step of every request as a JSON line
(prompt, position, the drafter's top logits per depth, the tree, drafts accepted), to compare a served run
with weaver's own engine step by step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

ALGORITHMS = {"WEAVER": "weaver", "DDTREE": "ddtree"}  # SGLang name -> weaver.builders method
DEFAULT_DRAFT_TOKENS = 16  # the tree's nodes with its root: a budget of 15, a 16-block drafter's chain
ADAPTER_ENV, CHILDREN_ENV, NODES_PER_CALL_ENV = "WEAVER_ADAPTER", "WEAVER_CHILDREN", "WEAVER_NODES_PER_CALL"
TRACE_ENV, RRS_PRIORITY_ENV, POOL_ENV, RESCORE_ENV = "WEAVER_TRACE", "WEAVER_RRS_PRIORITY", "WEAVER_POOL", "WEAVER_RESCORE"
SAMPLING_ENV, FIXED_CHILDREN_ENV = "WEAVER_SAMPLING", "WEAVER_FIXED_CHILDREN"
DRAFT_TEMPERATURE_ENV = "WEAVER_DRAFT_TEMPERATURE"
TRACE_TOP = 4  # the drafter's largest logits per depth a trace keeps (a fingerprint of its inputs)


@dataclass(frozen=True)
class WorkerSettings:
    """The worker's settings that SGLang's arguments cannot carry."""

    adapter: str | None
    children: int | None  # None: weaver's default for the adapter's pool
    nodes_per_call: int | None
    trace: str | None
    rrs_priority: str = "draft"
    pool: int | None = None  # None: the adapter's own pool
    rescore: int | None = None  # None: greedy Weaver trees by the wave search
    sampling: str = "rrs"  # the rule for sampled requests, one that verifies drawn trees
    fixed_children: int = 0  # sampled requests' children per node listed, not drawn (rrs reaches them)
    draft_temperature: float | None = None  # sampled requests' trees drawn at this temperature (None: the request's)

    @classmethod
    def from_env(cls) -> "WorkerSettings":
        from weaver.acceptance import DRAWN_TREE_RULES
        from weaver.calibration import RRS_PRIORITIES

        priority = os.environ.get(RRS_PRIORITY_ENV) or "draft"
        if priority not in RRS_PRIORITIES:
            raise ValueError(f"{RRS_PRIORITY_ENV} must be one of {list(RRS_PRIORITIES)}, got {priority!r}")
        sampling = os.environ.get(SAMPLING_ENV) or "rrs"
        if sampling not in DRAWN_TREE_RULES:  # the worker draws sampled requests' trees: a greedy tree's rule is biased
            raise ValueError(f"{SAMPLING_ENV} must be one of {DRAWN_TREE_RULES}, got {sampling!r}")
        fixed = _count(FIXED_CHILDREN_ENV, 0, least=0)
        if fixed and sampling != "rrs":  # only recursive rejection's residual draw reaches a child drawn with q = 0
            raise ValueError(f"{FIXED_CHILDREN_ENV} needs {SAMPLING_ENV}=rrs, got {sampling!r}")
        return cls(os.environ.get(ADAPTER_ENV) or None, _count(CHILDREN_ENV, None), _count(NODES_PER_CALL_ENV, None),
                   os.environ.get(TRACE_ENV) or None, priority, _count(POOL_ENV, None), _count(RESCORE_ENV, None),
                   sampling, fixed, _positive_number(DRAFT_TEMPERATURE_ENV))

    def record(self, **step) -> None:
        """Append one step to the trace file."""
        with open(self.trace, "a") as f:
            f.write(json.dumps(step) + "\n")


def _count(variable: str, default: int | None, least: int = 1) -> int | None:
    value = os.environ.get(variable)
    if value is None:
        return default
    if not value.isdigit() or int(value) < least:
        raise ValueError(f"{variable} must be a whole number >= {least}, got {value!r}")
    return int(value)


def _positive_number(variable: str) -> float | None:
    value = os.environ.get(variable)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0 < number < float("inf"):
        raise ValueError(f"{variable} must be a finite number > 0, got {value!r}")
    return number


def register() -> None:
    """Register every algorithm in ALGORITHMS with SGLang (idempotent: SGLang may call plugins again)."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    for name in ALGORITHMS:
        try:
            SpeculativeAlgorithm.from_string(name)
            continue  # already registered in this process
        except ValueError:
            pass
        SpeculativeAlgorithm.register(name, validate_server_args=configure, spec_class=_tree_spec_class())(
            _worker_factory(name))


def _tree_spec_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class TreeSpecAlgo(CustomSpecAlgo):
        """Scheduled like SGLang's NGRAM: drafts live outside SGLang's KV pools, the tree only in the verify
        mask, accepted tokens relayed as NGRAM's are. Hooks the scheduler calls that a plugin algorithm does
        not define (`create_future_map`, `need_topk`, ...) are NGRAM's."""

        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False

        def __getattr__(self, name: str):
            return getattr(SpeculativeAlgorithm.NGRAM, name)

    return TreeSpecAlgo


def configure(server_args) -> None:
    """SGLang's arguments this worker needs, set before anything loads; one clear error for a missing drafter."""
    if not server_args.speculative_draft_model_path:
        raise ValueError(f"--speculative-algorithm {server_args.speculative_algorithm} needs our drafter: "
                         "--speculative-draft-model-path <a DFlash-format drafter folder, e.g. from weaver's "
                         "`drafter` stage>")
    check_settings(server_args.speculative_algorithm.upper(), WorkerSettings.from_env())
    if server_args.speculative_num_draft_tokens is None:
        server_args.speculative_num_draft_tokens = DEFAULT_DRAFT_TOKENS
    if server_args.speculative_num_draft_tokens < 2:
        raise ValueError("--speculative-num-draft-tokens counts the tree's root: it must be at least 2 (budget 1)")
    server_args.speculative_num_steps = server_args.speculative_num_draft_tokens - 1  # KV reserved per step:
    server_args.speculative_eagle_topk = 1  # max(steps * topk, draft tokens) = the tree's size
    server_args.disable_overlap_schedule = True  # the worker is synchronous
    server_args.disable_radix_cache = True  # the drafter must see every prompt token's target states
    server_args.disable_cuda_graph = True  # the target's states are read with a forward hook
    server_args.enable_mixed_chunk = False


def check_settings(name: str, settings: WorkerSettings) -> None:
    """Refuse Weaver's environment settings that cannot work (no adapter for WEAVER, more children than the
    pool searched) from the adapter's config.json alone, before SGLang loads a model."""
    from weaver.builders import TREE_METHODS, check_children
    from weaver.models.adapter import read_adapter_config

    if "adapter" not in TREE_METHODS[ALGORITHMS[name]].needs:
        return
    if settings.adapter is None:
        raise ValueError(f"--speculative-algorithm {name} needs a trained adapter: set {ADAPTER_ENV} to its folder "
                         "(weaver's `weaver` stage writes it)")
    pool = settings.pool or read_adapter_config(settings.adapter)[0].pool_size
    if settings.children is not None:  # unset: weaver's default, within the pool
        check_children(settings.children, pool, CHILDREN_ENV)


def _worker_factory(name: str):
    def worker_class(server_args):
        from weaver.serving.sglang.worker import TreeWorker

        return type(f"{name.title()}Worker", (TreeWorker,), {"method": ALGORITHMS[name]})

    return worker_class
