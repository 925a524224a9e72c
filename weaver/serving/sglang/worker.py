"""WEAVER and DDTREE inside SGLang's scheduler: a speculative worker built from weaver's own drafting code.

Per decode step and request: our DFlash drafter drafts a block from its context cache of the target's
tapped hidden states, `weaver.builders.propose` (the reference engine's builders: no second search) turns
it into a tree, `tree_inputs` lays the batch's trees out as SGLang's tree-verify inputs, the target runs
one TARGET_VERIFY forward over them (a hybrid target's GDN layers through our tree kernels,
`weaver.serving.sglang.gdn`), SGLang's greedy tree verify accepts a path, SGLang commits the accepted nodes'
KV (and `gdn` the accepted path's GDN states), and the accepted nodes' tapped states extend the drafter's context.

To the scheduler the worker looks like SGLang's NGRAM worker (`TreeSpecAlgo.is_ngram`): the draft lives
outside SGLang's KV pools and the tree only in the verify mask, so the NGRAM relay, KV sizing and
server-argument rules apply unchanged. The target's hidden states are read with a forward hook on its
decoder stack, which CUDA-graph replays skip: launch with `--disable-cuda-graph` (the plugin sets it).
Tensor parallel size 1 only (the embedding and lm_head are read whole).
Greedy requests are verified by SGLang's greedy tree verify; sampled ones (temperature > 0) draw their
trees without replacement and are verified by our recursive rejection sampling or traversal verification
(`weaver.acceptance`, WEAVER_SAMPLING), at the request's temperature only: top-p, top-k, min-p and penalties are not applied to them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_device, get_spec
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.eagle_utils import eagle_sample
from sglang.srt.speculative.ngram_info import NgramVerifyInput
from sglang.srt.speculative.spec_utils import move_accept_tokens_to_target_kvcache
from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from torch import nn

from weaver.acceptance import SAMPLING_RULES
from weaver.builders import TREE_METHODS, SearchConfig, StepInputs, default_children, propose
from weaver.calibration import RRS_PRIORITIES
from weaver.errors import WeaverError
from weaver.models.adapter import WeaverAdapter, load_adapter, with_pool
from weaver.models.drafter import DrafterCache
from weaver.models.drafter_checkpoint import load_drafter
from weaver.search import Proposal
from weaver.serving.sglang import TRACE_TOP, WorkerSettings
from weaver.serving.sglang.gdn import begin_verify, commit_gdn_states, install_tree_gdn
from weaver.serving.sglang.tree_inputs import accept_outputs, accepted_leaves, tree_verify_inputs
from weaver.tree import Tree


@dataclass(frozen=True)
class TargetShape:
    """The target's sizes the drafter and adapter checks read (`check_pair`, `check_adapter_fits`)."""

    hidden_size: int
    vocab_size: int
    num_layers: int


class TargetHead(nn.Module):
    """What drafting reads from SGLang's target model: its token embedding and lm_head (vocabulary padding
    cut off), its sizes, and where its checkpoint lives (for the tokenizer fingerprint checks)."""

    def __init__(self, model: nn.Module, hf_config, checkpoint_dir: str):
        super().__init__()
        vocab = hf_config.vocab_size
        self.cfg = TargetShape(hf_config.hidden_size, vocab, hf_config.num_hidden_layers)
        self.embed = nn.Embedding.from_pretrained(model.model.embed_tokens.weight[:vocab], freeze=True)
        self.lm_head = nn.Linear(hf_config.hidden_size, vocab, bias=False)
        self.lm_head.weight = nn.Parameter(model.lm_head.weight[:vocab], requires_grad=False)
        self.checkpoint_dir = checkpoint_dir


@dataclass
class RequestState:
    """One request's drafting state between steps."""

    req: object  # SGLang's request (`finished()` ends this state)
    context: DrafterCache  # the drafter's cache of the committed tokens' tapped target states
    last_hidden: torch.Tensor  # (H,) the target's final-norm state of the last committed token
    decoding: bool = False  # has been in a decode batch (so leaving one means it finished or was retracted)
    temperature: float = 0.0  # 0: greedy
    generator: torch.Generator | None = None  # a sampled request's draws (trees and acceptance)
    proposal: Proposal | None = None  # the step in flight: its tree and the drafter's top logits (for the trace)
    top_logits: torch.Tensor | None = None


class TreeWorker(BaseSpecWorker):
    """The WEAVER / DDTREE speculative worker (`method` is set by the plugin's factory)."""

    method = "ddtree"

    def __init__(self, server_args: ServerArgs, gpu_id: int, nccl_port: int, target_worker: TpModelWorker):
        super().__init__()
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.device = get_device().device
        self.draft_token_num = get_spec().speculative_num_draft_tokens
        self.speculative_num_draft_tokens = self.draft_token_num
        self.settings = WorkerSettings.from_env()
        model, hf_config = self.model_runner.model, self.model_runner.model_config.hf_config
        self.head = TargetHead(model, hf_config, server_args.model_path).to(self.device)
        self.dtype = self.head.lm_head.weight.dtype  # the target's: drafting reads its embeddings and states
        self.drafter = load_drafter(get_spec().speculative_draft_model_path, self.head, self.dtype).to(self.device)
        self.adapter = self._load_adapter()
        pool = self.adapter.cfg.pool_size if self.adapter is not None else None
        self.children = self.settings.children or default_children(pool)
        self.priority = RRS_PRIORITIES[self.settings.rrs_priority]()  # sampled requests' trees, learnt from all of them
        self._tap_states(model)
        self.requests: dict[str, RequestState] = {}

    @functools.cached_property
    def gdn(self):
        """The target's GDN backend with our tree verify, installed at the first verify (SGLang builds its attention
        backends after the speculative worker); None for an attention-only target."""
        return install_tree_gdn(self.model_runner)

    @property
    def target_worker(self) -> TpModelWorker:
        return self._target_worker

    @property
    def draft_worker(self):
        return None  # no SGLang draft model: our drafter runs inside this worker

    def alloc_memory_pool(self, **kwargs) -> None:
        self.req_to_token_pool, self.token_to_kv_pool_allocator = self._target_worker.get_memory_pool()

    def clear_cache_pool(self) -> None:
        self.requests.clear()

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
        pass

    def _load_adapter(self) -> WeaverAdapter | None:
        """The adapter WEAVER_ADAPTER names (`configure` refused a WEAVER launch without one)."""
        if "adapter" not in TREE_METHODS[self.method].needs:
            return None
        adapter = load_adapter(self.settings.adapter, self.head, self.drafter.cfg.block_size - 1)
        return with_pool(adapter, self.settings.pool).to(self.device, self.dtype)

    def _tap_states(self, model: nn.Module) -> None:
        """Have the target keep its tapped layers' outputs, and stash them (with the final-norm states) after
        every forward of its decoder stack."""
        taps = list(self.drafter.cfg.target_layer_ids)
        last = self.head.cfg.num_layers - 1
        if last in taps:  # SGLang captures a layer's output as the next layer's input
            raise WeaverError(f"the drafter taps the target's last layer ({last}), which SGLang cannot expose")
        if not hasattr(model, "set_dflash_layers_to_capture"):
            raise WeaverError(f"SGLang's {type(model).__name__} cannot expose its layers' states to a drafter")
        model.set_dflash_layers_to_capture(taps)
        self.tap_order = sorted(range(len(taps)), key=taps.__getitem__)  # SGLang returns them by layer index
        self.stashed: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        model.model.register_forward_hook(self._stash)

    def _stash(self, module: nn.Module, args, output) -> None:
        hidden, aux = output
        captured = list(aux.split(hidden.shape[-1], dim=-1)) if torch.is_tensor(aux) else list(aux)
        by_tap = [None] * len(captured)
        for position, tap in enumerate(self.tap_order):
            by_tap[tap] = captured[position]
        self.stashed = hidden, by_tap

    # --- one scheduler iteration ---

    def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            return self._speculate(batch, on_publish, pp_proxy_tensors)
        result = self._target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors)
        if batch.forward_mode.is_extend():
            self._read_prompts(batch)
        bs, n = len(batch.reqs), self.draft_token_num
        accept_tokens = torch.zeros(bs, n, dtype=torch.int32, device=self.device)
        accept_tokens[:, 0] = result.next_token_ids
        accept_lens = torch.ones(bs, dtype=torch.int32, device=self.device)  # the target's own next token
        new_seq_lens = batch.seq_lens.clone()
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            logits_output=result.logits_output, next_token_ids=result.next_token_ids,
            can_run_cuda_graph=result.can_run_cuda_graph, accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            speculative_num_draft_tokens=n,
            next_draft_input=NgramVerifyInput(draft_token_num=n, new_seq_lens=new_seq_lens,
                                              accept_tokens=accept_tokens.flatten(), accept_lens=accept_lens),
        )

    def _read_prompts(self, batch) -> None:
        """Start (or, for a chunked prefill, extend) each request's drafter context with the prompt tokens'
        tapped states from this extend forward."""
        hidden, taps = self.stashed
        start = 0
        for req, prefix, length in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            state = self.requests.get(req.rid)
            if prefix == 0:  # a new request, or one SGLang prefills again after retracting it
                longest = len(req.origin_input_ids) + req.sampling_params.max_new_tokens + self.draft_token_num
                state = self.requests[req.rid] = RequestState(req, self.drafter.new_cache(1, longest), hidden[0])
            elif state is None:
                raise WeaverError("a prompt prefix was served from SGLang's cache, so the drafter never saw it: "
                                  "launch with --disable-radix-cache (the weaver plugin sets it)")
            rows = slice(start, start + length)
            positions = torch.arange(prefix, prefix + length, device=self.device)[None]
            self.drafter.extend_context(state.context, [t[rows][None] for t in taps], positions)
            state.last_hidden = hidden[start + length - 1]
            start += length

    def _speculate(self, batch, on_publish, pp_proxy_tensors) -> GenerationBatchResult:
        self._forget_departed(batch)
        trees = [self._draft(req, int(seq_len)) for req, seq_len in zip(batch.reqs, batch.seq_lens.tolist())]
        verify = self._verify_input(batch, trees)
        result = self._target_worker.forward_batch_generation(batch, pp_proxy_tensors=pp_proxy_tensors, is_verify=True)
        predict, accept_lens, accept_index = eagle_sample(verify, batch, result.logits_output, None,
                                                          watermark_state=self.model_runner.watermark_state)
        if any(self.requests[req.rid].generator is not None for req in batch.reqs):
            predict, accept_lens, accept_index = self._sampled_acceptance(
                batch, result.logits_output.next_token_logits, predict, accept_lens, accept_index)
        new_seq_lens = batch.seq_lens + accept_lens
        if self.gdn is not None:
            commit_gdn_states(self.gdn, [leaf for leaf, _ in accepted_leaves(accept_index, accept_lens - 1, predict)])
        accept_tokens = predict[accept_index].flatten()
        move_accept_tokens_to_target_kvcache(batch, accept_index, accept_lens - 1, self.token_to_kv_pool_allocator)
        if batch.return_logprob:
            compute_spec_logprobs(batch, result.logits_output, predict, accept_index=accept_index)
        self._commit_contexts(batch, accept_index, accept_lens)
        if on_publish is not None:
            on_publish(new_seq_lens)
        batch.forward_mode = ForwardMode.DECODE
        return GenerationBatchResult(
            logits_output=result.logits_output, next_token_ids=accept_tokens,
            can_run_cuda_graph=result.can_run_cuda_graph, accept_lens=accept_lens, new_seq_lens=new_seq_lens,
            speculative_num_draft_tokens=self.draft_token_num,
            next_draft_input=NgramVerifyInput(draft_token_num=self.draft_token_num, new_seq_lens=new_seq_lens,
                                              accept_tokens=accept_tokens, accept_lens=accept_lens),
        )

    def _forget_departed(self, batch) -> None:
        """Drop the drafting state of finished requests and of decoding ones that left the decode batch
        (retracted: SGLang prefills them again). A request between the chunks of its prefill keeps its state."""
        live = {req.rid for req in batch.reqs}
        for rid, state in list(self.requests.items()):
            if state.req.finished() or (state.decoding and rid not in live):
                del self.requests[rid]
        for req in batch.reqs:
            self.requests[req.rid].decoding = True

    @torch.inference_mode()
    def _draft(self, req, seq_len: int) -> Tree:
        """The request's draft tree: anchor = its last output token (not yet in the KV cache, at position
        seq_len), block drafted from its context, tree built by `weaver.builders.propose` (children drawn
        without replacement for a sampled request)."""
        state, anchor = self.requests[req.rid], req.output_ids[-1]
        if state.generator is None and req.sampling_params.top_k != 1:  # SGLang's greedy is top_k == 1
            state.temperature, state.generator = req.sampling_params.temperature, self._generator(req)
        budget = self.draft_token_num - 1
        draft = self.drafter.draft(self.head, state.context, torch.tensor([anchor], device=self.device),
                                   torch.tensor([seq_len], device=self.device), max_depth=budget)
        sampled = state.generator is not None
        search = SearchConfig(budget, self.children, self.settings.nodes_per_call, state.generator,
                              self._tree_temperature(state), priority=self.priority if sampled else None,
                              rescore=self.settings.rescore,
                              fixed_children=self.settings.fixed_children if sampled else 0)
        state.proposal = propose(self.method, StepInputs(anchor, draft, state.last_hidden, self.head, adapter=self.adapter),
                                 search)
        if self.settings.trace:  # the trace's fingerprint of the drafter's inputs; off the hot path otherwise
            state.top_logits = draft.logits[0].topk(TRACE_TOP).values
        return state.proposal.tree

    def _tree_temperature(self, state: RequestState) -> float:
        """The temperature a sampled request's tree is drawn at (WEAVER_DRAFT_TEMPERATURE, else the request's own;
        the rules verify against the request's); 1 for greedy trees, which are not drawn."""
        if state.generator is None:
            return 1.0
        return self.settings.draft_temperature or state.temperature or 1.0

    def _generator(self, req) -> torch.Generator:
        """A sampled request's own random stream: from its `sampling_seed`, else fresh entropy."""
        generator = torch.Generator(device=self.device)
        seed = req.sampling_params.sampling_seed
        generator.manual_seed(seed) if seed is not None else generator.seed()
        return generator

    def _sampled_acceptance(self, batch, logits: torch.Tensor, predict: torch.Tensor, accept_lens: torch.Tensor,
                            accept_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sampled requests accepted by our rule over their drawn trees (WEAVER_SAMPLING: recursive rejection
        sampling or traversal verification; lossless for the target's temperature-T distribution; SGLang's own rule
        would be target-only sampling on a GPU and is greedy on a CPU), greedy ones as SGLang's verify decided; in
        SGLang's (predict, accept_lens, accept_index) layout for its KV commit."""
        n, states = self.draft_token_num, [self.requests[req.rid] for req in batch.reqs]
        leaves = accepted_leaves(accept_index, accept_lens - 1, predict)
        rule = SAMPLING_RULES[self.settings.sampling]
        for b, state in enumerate(states):
            if state.generator is not None:
                tree = state.proposal.tree
                leaves[b] = rule.accept(tree, logits[b * n : b * n + len(tree)], state.proposal, state.temperature,
                                        state.generator, self.priority.observer(state.proposal) if self.priority else None)
        if self.priority:
            self.priority.refresh()
        predict, accept_index, drafts = accept_outputs([state.proposal.tree for state in states], leaves, n)
        return predict, drafts + 1, accept_index

    def _verify_input(self, batch, trees: list[Tree]) -> NgramVerifyInput:
        """Turn the decode batch into a TARGET_VERIFY batch over the trees (SGLang's CPU attention reads the
        mask in its QLEN_ONLY layout, GPU backends the full one)."""
        n = self.draft_token_num
        full_mask = batch.seq_lens.device.type != "cpu"
        inputs = tree_verify_inputs(trees, batch.seq_lens, n, full_mask=full_mask)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = inputs.draft_token
        batch.out_cache_loc = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=batch.req_to_token_pool.req_to_token,
            start_offset=batch.seq_lens, end_offset=batch.seq_lens + n, batch_size=len(trees), draft_token_num=n,
            device=self.device)
        batch.spec_info = NgramVerifyInput(
            draft_token=inputs.draft_token, custom_mask=inputs.custom_mask, positions=inputs.positions,
            retrieve_index=inputs.retrieve_index, retrieve_next_token=inputs.retrieve_next_token,
            retrieve_next_sibling=inputs.retrieve_next_sibling, draft_token_num=n)
        if self.gdn is not None:
            begin_verify(self.gdn, inputs.parents)
        return batch.spec_info

    def _commit_contexts(self, batch, accept_index: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """Extend each drafter context by the committed nodes (the root and the accepted drafts)."""
        hidden, taps = self.stashed
        for b, (req, seq_len, length) in enumerate(zip(batch.reqs, batch.seq_lens.tolist(), accept_lens.tolist())):
            nodes = accept_index[b, :length].long()
            positions = torch.arange(seq_len, seq_len + length, device=self.device)[None]
            state = self.requests[req.rid]
            self.drafter.extend_context(state.context, [t[nodes][None] for t in taps], positions)
            state.last_hidden = hidden[nodes[-1]]
            if self.settings.trace:
                tree = state.proposal.tree
                self.settings.record(prompt=list(req.origin_input_ids), position=seq_len,
                                     top_logits=state.top_logits.tolist(), tree_tokens=tree.tokens.tolist(),
                                     tree_parents=tree.parents.tolist(), accepted=length - 1)
