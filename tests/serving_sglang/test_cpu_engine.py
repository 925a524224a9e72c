"""Tree speculative decoding end to end on CPU through `sglang.Engine` on the tiny target: SGLang's own NGRAM,
and our WEAVER and DDTREE workers (weaver/serving/sglang/worker.py, found through the plugin's entry point),
whose greedy output must equal plain greedy decoding and whose every request must take exactly the
verify steps and accept exactly the drafts that weaver's own engine does on the same checkpoints.

`cpu_engine/` stands in for the CUDA build of sgl_kernel (its `common_ops.py`: the ops plain and NGRAM
decode call) and gives SGLang's `torch_native` backend a tree-masked verify (`tree_verify_backend.py`).
The engines run in a child process (this file run as a script) with that folder on PYTHONPATH and
SGLANG_USE_CPU_ENGINE=1, which SGLang reads at import: this pytest process, shared with the other tests of
the folder, keeps SGLang's default (non-CPU) paths. The ops and the attention are checked here directly,
against SGLang's Triton kernels (TRITON_INTERPRET=1) or a brute-force reference.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType, SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from checkpoints import (  # noqa: E402
    ADAPTER, DRAFTER, MAX_NEW_TOKENS, NUM_DRAFT_TOKENS, REFERENCE, SAMPLED_PROMPT, SAMPLED_RUNS, SAMPLED_TEMPERATURE,
    TARGET, checkpoint, prompts,
)
from scipy.stats import chi2  # noqa: E402

ENGINE_FOLDER = Path(__file__).resolve().parent / "cpu_engine"
ENGINE_ARGS = dict(
    device="cpu", attention_backend="torch_native", skip_tokenizer_init=True, disable_cuda_graph=True,
    mem_fraction_static=0.2, max_total_tokens=4096, dtype="float32", log_level="error",
)
NGRAM_ARGS = dict(
    speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, speculative_ngram_max_trie_depth=4
)
WORKERS = ("ddtree", "weaver")  # our algorithms, by weaver.builders method name


# --- the engines, in a child process ----------------------------------------------------------------------


def run_engines(target: str, drafter: str, out: str) -> None:
    """Plain greedy, then NGRAM, DDTREE and WEAVER greedy, on the same requests, and the workers' sampled runs;
    token ids, logprobs and spec stats to `out`."""
    import sglang as sgl

    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    singles, batch = prompts(vocab)
    sampling = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}
    # prompts of more than 8 tokens are prefilled in chunks: the drafter's context must grow with each chunk
    ours = dict(speculative_draft_model_path=drafter, speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
                chunked_prefill_size=8)
    results = {}
    engines = [("plain", {}), ("ngram", NGRAM_ARGS)]
    engines += [(method, dict(speculative_algorithm=method.upper(), **ours)) for method in WORKERS]
    for name, extra in engines:
        os.environ["WEAVER_TRACE"] = str(Path(out).with_name(f"{name}.trace.jsonl"))  # read by our workers
        os.environ["WEAVER_RRS_PRIORITY"] = "acceptance" if name == "weaver" else "draft"  # both kinds of sampled tree
        os.environ["WEAVER_SAMPLING"] = "rrs" if name == "weaver" else "traversal"  # both rules for drawn trees
        os.environ["WEAVER_FIXED_CHILDREN"] = "1" if name == "weaver" else "0"  # a child per node listed, not drawn
        os.environ["WEAVER_DRAFT_TEMPERATURE"] = "0.6"  # trees drawn flatter than the requests' 0.3, which the rules verify
        engine = sgl.Engine(model_path=target, **ENGINE_ARGS, **extra)
        try:
            runs = [engine.generate(input_ids=[p], sampling_params=sampling, return_logprob=True) for p in singles]
            runs.append(engine.generate(input_ids=batch, sampling_params=sampling, return_logprob=True))
            if name in WORKERS:
                # a seed per request, which seeds SGLang's sampler and our worker's draws: the chi-square test below
                # then runs on seeded draws, as the engine-side statistical tests do, not on fresh ones each run
                sampled = engine.generate(input_ids=[SAMPLED_PROMPT] * SAMPLED_RUNS, sampling_params=[
                    {"max_new_tokens": 3, "temperature": SAMPLED_TEMPERATURE, "sampling_seed": seed}
                    for seed in range(SAMPLED_RUNS)])
                results[f"{name}_sampled"] = [{"ids": o["output_ids"], "drafts": o["meta_info"].get("spec_num_correct_drafts", 0)}
                                              for o in sampled]
        finally:
            engine.shutdown()
        results[name] = [
            [
                {
                    "ids": o["output_ids"],
                    "logprobs": [lp for lp, *_ in o["meta_info"]["output_token_logprobs"]],
                    "spec": {k: v for k, v in o["meta_info"].items() if k.startswith("spec_")},
                }
                for o in outputs
            ]
            for outputs in runs
        ]
    Path(out).write_text(json.dumps(results))


@pytest.fixture(scope="module")
def engine_runs(tmp_path_factory) -> dict:
    target, drafter = checkpoint(TARGET), checkpoint(DRAFTER)
    out = tmp_path_factory.mktemp("cpu_engine") / "runs.json"
    env = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ENGINE_FOLDER), os.environ.get("PYTHONPATH")])),
        "WEAVER_ADAPTER": str(checkpoint(ADAPTER)),  # what a user sets for --speculative-algorithm WEAVER
    }
    run = subprocess.run([sys.executable, __file__, str(target), str(drafter), str(out)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    runs = json.loads(out.read_text())
    for method in WORKERS:
        trace = [json.loads(line) for line in out.with_name(f"{method}.trace.jsonl").read_text().splitlines()]
        runs[f"{method}_trace"] = trace
    return runs


def test_ngram_greedy_equals_plain_greedy(engine_runs):
    plain, ngram = engine_runs["plain"], engine_runs["ngram"]
    assert len(plain) == len(ngram) == 5 and len(plain[-1]) == 3  # four single requests, a batch of three
    for plain_run, ngram_run in zip(plain, ngram):
        for p, s in zip(plain_run, ngram_run, strict=True):
            assert len(p["ids"]) == MAX_NEW_TOKENS
            assert s["ids"] == p["ids"]
            # verify logits match decode logits: a verify that lets a node see a sibling branch shifts them
            assert s["logprobs"] == pytest.approx(p["logprobs"], abs=1e-4)


def test_ngram_accepts_drafts(engine_runs):
    specs = [o["spec"] for run in engine_runs["ngram"] for o in run]
    assert all(s["spec_verify_ct"] > 0 for s in specs), specs
    # the concurrent batch, and the patterned prompts, each get drafts accepted
    assert sum(s["spec_num_correct_drafts"] for s in specs[-3:]) > 0, specs
    assert all(s["spec_num_correct_drafts"] > 0 for s in specs[2:4]), specs
    # some verify steps accept two drafts or more (histogram[k]: verify steps with k correct drafts)
    assert sum(sum(s["spec_correct_drafts_histogram"][2:]) for s in specs) > 0, specs


@pytest.mark.parametrize("method", WORKERS)
def test_our_worker_greedy_equals_plain_greedy(engine_runs, method):
    for plain_run, our_run in zip(engine_runs["plain"], engine_runs[method], strict=True):
        for p, s in zip(plain_run, our_run, strict=True):
            assert s["ids"] == p["ids"]
            assert s["logprobs"] == pytest.approx(p["logprobs"], abs=1e-4)


@pytest.mark.parametrize("method", WORKERS)
def test_our_worker_takes_the_reference_engines_steps(engine_runs, method):
    """Per request, alone or in a concurrent batch: the verify steps and accepted drafts of weaver's own
    engine (`speculative_generate`, batch 1) on the same checkpoints. Different drafter inputs (tapped states,
    positions, the anchor) or trees would change them; so would a wrong commit of the drafter's context."""
    reference = json.loads(checkpoint(REFERENCE).read_text())[method]
    ours = [o["spec"] for run in engine_runs[method] for o in run]
    assert [(s["spec_verify_ct"], s["spec_num_correct_drafts"]) for s in ours] == [
        (r["steps"], r["accepted"]) for r in reference]
    assert sum(r["accepted"] for r in reference) >= 5  # the comparison covers accepted drafts, not only misses


@pytest.mark.parametrize("method", WORKERS)
def test_our_worker_drafts_what_the_reference_engine_drafts(engine_runs, method):
    """Step by step (the workers' WEAVER_TRACE): the same drafts accepted, and the drafter's top logits per
    depth equal to weaver's own engine's; these move with any error in the drafter's inputs (tapped target
    states, their positions, the anchor), even one that leaves the argmax trees unchanged."""
    steps: dict[tuple, list[dict]] = {}
    for step in engine_runs[f"{method}_trace"]:
        steps.setdefault(tuple(step["prompt"]), []).append(step)
    for request in json.loads(checkpoint(REFERENCE).read_text())[method]:
        served = steps[tuple(request["prompt"])]
        assert [s["accepted"] for s in served] == request["per_step"]
        assert [s["position"] for s in served] == sorted(s["position"] for s in served)
        for s, expected in zip(served, request["top_logits"], strict=True):
            torch.testing.assert_close(torch.tensor(s["top_logits"]), torch.tensor(expected), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", WORKERS)
def test_our_worker_samples_the_targets_distribution(engine_runs, method):
    """Sampled requests (temperature 0.3) through drawn trees (DDTREE's ranked by draft probability and verified by
    traversal, WEAVER's ranked by the worker's acceptance table, WEAVER_RRS_PRIORITY, with one fixed child per node,
    WEAVER_FIXED_CHILDREN, and verified by recursive rejection sampling; WEAVER_SAMPLING; both drawn from the draft at
    another temperature than the requests', WEAVER_DRAFT_TEMPERATURE): the 2nd and 3rd
    tokens of many runs against their exact distributions (Pearson chi-square; cells expecting fewer than 5 draws
    pooled). SGLang's own CPU verify would be greedy here and fail it. With this random drafter
    about 9% of the drafts are accepted (tens per run): enough to exercise the accepted-draft path of the
    worker's wiring (its trees' draws, the verify rows, the commit); the rule's own statistics are tested in
    tests/test_acceptance_rules.py."""
    runs = engine_runs[f"{method}_sampled"]
    assert len(runs) == SAMPLED_RUNS and all(len(r["ids"]) == 3 for r in runs)
    exact = json.loads(checkpoint(REFERENCE).read_text())["sampled"]
    for position, probs in zip((1, 2), exact):
        counts = torch.bincount(torch.tensor([r["ids"][position] for r in runs]), minlength=len(probs)).double()
        expected = torch.tensor(probs) * len(runs)
        small = expected < 5
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        stat = float(((counts - expected) ** 2 / expected).sum())
        assert chi2.sf(stat, len(expected) - 1) > 1e-4, (position, stat, len(expected))
    assert sum(r["drafts"] for r in runs) > 0


def test_the_serving_benchmark_runs(tmp_path):
    """benchmarks/serve_sglang.py: plain, DDTREE and WEAVER through SGLang's engine, outputs equal to plain."""
    (tmp_path / "prompts.json").write_text(json.dumps([[1, 2, 3, 4, 5, 6], [30, 31, 32, 30, 31, 33]]))
    script = ENGINE_FOLDER.parents[2] / "benchmarks" / "serve_sglang.py"
    run = subprocess.run(
        [sys.executable, str(script), "--target", str(checkpoint(TARGET)), "--drafter", str(checkpoint(DRAFTER)),
         "--adapter", str(checkpoint(ADAPTER)), "--prompt-ids", str(tmp_path / "prompts.json"), "--max-new-tokens", "8",
         "--cpu-stand-ins", str(ENGINE_FOLDER), "--out", str(tmp_path / "out.json")],
        capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    results = json.loads((tmp_path / "out.json").read_text())
    assert [r["method"] for r in results] == ["plain", "DDTREE", "WEAVER"]
    assert all(r["ids"] == results[0]["ids"] and len(r["ids"][0]) == 8 for r in results)


# --- the shim's pieces, in this process --------------------------------------------------------------------


def load(name: str) -> ModuleType:
    """A cpu_engine module by path under a private name: neither sys.path nor `common_ops` change here."""
    path = ENGINE_FOLDER / f"{name}.py"
    module_name = f"_cpu_engine_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, path)
        sys.modules[module_name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module_name])
    return sys.modules[module_name]


@pytest.fixture(scope="module")
def ops():
    load("common_ops")
    return torch.ops.sgl_kernel


def random_parents(size: int, gen: torch.Generator) -> list[int]:
    """A random tree in topological order (parent < child); node 0 is the root; from 3 nodes on, never a chain."""
    parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, size)]
    if size > 2:
        parents[2] = 0  # nodes 1 and 2 are siblings
    return parents


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: row i sees column j iff j is i or one of its ancestors (SGLang's QLEN_ONLY layout)."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


def test_tree_verify_attention_matches_per_path_attention():
    backend_module = load("tree_verify_backend")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, n, prefix_lens = 4, 2, 8, 7, [5, 0, 9]
    bs, slots = len(prefix_lens), 64
    trees = [random_parents(n, gen) for _ in range(bs)]
    k_cache, v_cache = (torch.randn(slots, kv_heads, dim, generator=gen) for _ in range(2))
    req_to_token = torch.randperm(slots, generator=gen).view(4, 16).int()  # distinct slots: no overwrites
    req_pool_indices = torch.tensor([2, 0, 3])
    out_cache_loc = torch.cat([req_to_token[r, p : p + n] for r, p in zip(req_pool_indices, prefix_lens)]).long()
    q = torch.randn(bs * n, heads * dim, generator=gen)
    k, v = torch.randn(bs * n, kv_heads * dim, generator=gen), torch.randn(bs * n, kv_heads * dim, generator=gen)

    class Pool:  # the KV pool calls the backend makes
        def set_kv_buffer(self, layer, loc, cache_k, cache_v):
            k_cache[loc.loc], v_cache[loc.loc] = cache_k.view(-1, kv_heads, dim), cache_v.view(-1, kv_heads, dim)

        def get_key_buffer(self, layer_id):
            return k_cache

        def get_value_buffer(self, layer_id):
            return v_cache

    backend = object.__new__(backend_module.TreeVerifyTorchNativeAttnBackend)
    backend.token_to_kv_pool, backend.swa_out_cache_loc = Pool(), None
    backend.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    layer = SimpleNamespace(tp_q_head_num=heads, tp_k_head_num=kv_heads, qk_head_dim=dim, v_head_dim=dim,
                            scaling=0.3, layer_id=0, is_cross_attention=False, sliding_window_size=-1)
    tree_mask = torch.stack([ancestor_mask(parents) for parents in trees])
    batch = SimpleNamespace(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, seq_lens=torch.tensor(prefix_lens),
        req_pool_indices=req_pool_indices, out_cache_loc=out_cache_loc,
        spec_info=SimpleNamespace(draft_token_num=n, custom_mask=tree_mask.flatten()),
    )
    out = backend.forward_extend(q, k, v, layer, batch).view(bs, n, heads, dim)

    # brute force: each node attends to the prefix and to its root-to-node path, as one plain sequence
    q_, k_, v_ = q.view(bs, n, heads, dim), k.view(bs, n, kv_heads, dim), v.view(bs, n, kv_heads, dim)
    for b, parents in enumerate(trees):
        prefix = req_to_token[req_pool_indices[b], : prefix_lens[b]].long()
        for i in range(n):
            path, j = [], i
            while j != -1:
                path, j = [j, *path], parents[j]
            keys, values = torch.cat([k_cache[prefix], k_[b, path]]), torch.cat([v_cache[prefix], v_[b, path]])
            for h in range(heads):
                weights = torch.softmax(keys[:, h * kv_heads // heads] @ q_[b, i, h] * 0.3, dim=0)
                expected = weights @ values[:, h * kv_heads // heads]
                torch.testing.assert_close(out[b, i, h], expected, atol=1e-5, rtol=1e-5)

    # the tree matters: the stock backend's causal attention over the flattened tree gives other outputs
    causal = backend_module.tree_verify_attention(
        q.view(-1, heads, dim), k_cache, v_cache, req_to_token, req_pool_indices, torch.tensor(prefix_lens),
        torch.ones(n, n, dtype=torch.bool).tril().expand(bs, n, n), 0.3, True,
    ).view(bs, n, heads, dim)
    assert not torch.allclose(causal, out, atol=1e-3)


def test_reconstruct_indices_from_tree_mask_matches_sglang_triton(ops, monkeypatch):
    import sglang.srt.utils

    # reconstruct_tree.py imports the CUDA sgl_kernel unless it believes it runs on XPU
    monkeypatch.setattr(sglang.srt.utils, "is_xpu", lambda: True)
    monkeypatch.delitem(sys.modules, "sglang.kernels.ops.speculative.reconstruct_tree", raising=False)
    from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton

    sys.modules.pop("sglang.kernels.ops.speculative.reconstruct_tree")  # leave no XPU-minded module behind
    gen = torch.Generator().manual_seed(2)
    for n in (1, 4, 7):
        bs = 3
        mask = torch.stack([ancestor_mask(random_parents(n, gen)) for _ in range(bs)]).flatten()
        seq_lens = torch.tensor([3, 10, 0])
        outs = [[torch.full((bs * n,), 99, dtype=torch.int64)] + [torch.full((bs, n), 99, dtype=torch.int64)
                                                                   for _ in range(3)] for _ in range(2)]
        ops.reconstruct_indices_from_tree_mask_cpu(mask, seq_lens, *outs[0], bs, n)
        reconstruct_indices_from_tree_mask_triton(mask, seq_lens, *outs[1], bs, n)
        for mine, theirs in zip(*outs):
            assert torch.equal(mine, theirs)


def test_verify_tree_greedy_matches_sglang_triton(ops):
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    gen = torch.Generator().manual_seed(3)
    bs, n, vocab = 4, 7, 3  # a tiny vocab so that target and drafts often agree
    for _ in range(20):
        mask = torch.stack([ancestor_mask(random_parents(n, gen)) for _ in range(bs)]).flatten()
        positions, index, next_token, next_sibling = (torch.empty(bs * n, dtype=torch.int64),
                                                      *(torch.empty(bs, n, dtype=torch.int64) for _ in range(3)))
        prefix_lens = torch.zeros(bs, dtype=torch.int64)
        ops.reconstruct_indices_from_tree_mask_cpu(mask, prefix_lens, positions, index, next_token, next_sibling, bs, n)
        candidates = torch.randint(0, vocab, (bs, n), generator=gen)
        target_predict = torch.randint(0, vocab, (bs, n), generator=gen)
        outs = [(torch.zeros(bs * n, dtype=torch.int32), torch.full((bs, n), -1, dtype=torch.int32),
                 torch.zeros(bs, dtype=torch.int32)) for _ in range(2)]
        ops.verify_tree_greedy_cpu(*outs[0], candidates, index, next_token, next_sibling, target_predict)
        verify_tree_greedy_triton(*outs[1], candidates, index, next_token, next_sibling, target_predict)
        for mine, theirs in zip(*outs):
            assert torch.equal(mine, theirs)


def ragged_requests(gen: torch.Generator, bs: int = 4, pool_len: int = 24):
    req_to_token = torch.randint(1, 1000, (6, pool_len), generator=gen, dtype=torch.int32)
    req_pool_indices = torch.randperm(6, generator=gen)[:bs]
    start = torch.randint(0, 10, (bs,), generator=gen)
    end = start + torch.tensor([4, 0, 7, 1])[:bs]
    return req_pool_indices, req_to_token, start, end


def test_assign_extend_cache_locs_matches_sglang_triton(ops):
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs

    req_pool_indices, req_to_token, start, end = ragged_requests(torch.Generator().manual_seed(4))
    outs = [torch.full((int((end - start).sum()) + 2,), -5, dtype=torch.int64) for _ in range(2)]
    ops.assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start, end, outs[0], req_to_token.shape[1])
    assign_extend_cache_locs[(len(start),)](req_pool_indices, req_to_token, start, end, outs[1],
                                            req_to_token.shape[1], 4)
    assert torch.equal(outs[0], outs[1]) and (outs[0][:-2] > 0).all()


def test_assign_req_to_token_pool_matches_sglang_triton(ops):
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool

    req_pool_indices, req_to_token, start, end = ragged_requests(torch.Generator().manual_seed(5))
    new_slots = torch.arange(2000, 2000 + int((end - start).sum()), dtype=torch.int64)
    pools = [req_to_token.clone() for _ in range(2)]
    ops.assign_req_to_token_pool_cpu(req_pool_indices, pools[0], start, end, new_slots, req_to_token.shape[1])
    assign_req_to_token_pool[(len(start),)](req_pool_indices, pools[1], start, end, new_slots,
                                            req_to_token.shape[1], 4)
    assert torch.equal(pools[0], pools[1]) and not torch.equal(pools[0], req_to_token)


def test_fill_accept_out_cache_loc_matches_sglang_triton(ops):
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc

    accept_index = torch.tensor([[0, 2, -1, -1], [4, -1, -1, -1], [8, 9, 11, -1]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 112, dtype=torch.int64)
    outs = [torch.zeros(accept_index.numel(), dtype=torch.int64) for _ in range(2)]
    ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, outs[0])
    fill_accept_out_cache_loc[(accept_index.numel(),)](accept_index, out_cache_loc, outs[1], 16)
    assert torch.equal(outs[0], outs[1])
    assert outs[0][:6].tolist() == [100, 102, 104, 108, 109, 111]


def test_copy_all_layer_kv_cache_moves_slots_in_every_buffer(ops):
    gen = torch.Generator().manual_seed(6)
    buffers = [torch.randn(16, 2, 3, generator=gen), torch.randn(16, 5, generator=gen).half()]
    expected = [b.clone() for b in buffers]
    tgt, src = torch.tensor([3, 4, 5, 9]), torch.tensor([2, 3, 4, 15])  # overlapping: all reads precede writes
    for b in expected:
        b[tgt] = b[src].clone()
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in buffers], dtype=torch.int64)
    ops.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for b, e in zip(buffers, expected):
        assert torch.equal(b, e)


if __name__ == "__main__":  # the child process of `engine_runs`
    run_engines(*sys.argv[1:4])
