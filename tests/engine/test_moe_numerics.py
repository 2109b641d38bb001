"""Expert LoRA numerics (services/lora/experts.py) on every mixture-of-experts family, against a direct
torch reference written here: a plain loop over tokens and their top-k experts that re-implements the
routed-experts forward from the base module's own weights, with each token's adapter's LoRA delta on
the experts it was routed to (A_e = lora_A rows e*r..(e+1)*r, B_e = lora_B columns e, E+e, 2E+e, ...,
scale alpha / expert_rank), the family's GLU written out again (GPT-OSS: interleaved, clamped).

Model level: two expert adapters (different ranks, so different buckets) and an attention-only one
co-batched with LoraModel.route, rows interleaved and a row without adapter; the reference replaces
each MultiLoraExperts' forward (same router outputs: the MoE block computes them for both). Logits,
loss and the gradient of every LoRA parameter agree within 1e-5 in float32. Layer level: router
outputs chosen by the test (every adapter sees only some experts), both LoRA paths of
``_Bucket.deltas`` (grouped_mm; its fallback with one padded chunk, and with a chunk per slice length). Also: every router logit tied, gradients
only in the owning adapter, exactly zero gradients on experts an adapter's tokens never reach, rows
without adapter equal the base model. CPU float32 only (the grouped_mm path is CUDA bf16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from temper.services.lora import experts as experts_module
from temper.services.lora import grouped_matmul
from temper.services.lora.layer import Routing
from temper.services.lora.model import AdapterSpec, LoraModel
from temper.services.models.loading import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ("qwen3_moe", "gpt_oss", "deepseek_v3")
TOL = dict(atol=1e-5, rtol=1e-5)
ROWS, SEQ = 6, 10   # SEQ > GPT-OSS's tiny sliding window (8)
# row -> adapter: interleaved, unsorted, one row without adapter (2)
OWNERS = ["a", "b", None, "a", "b", "c"]




@pytest.fixture(scope="module")
def folders(family_dirs) -> dict[str, Path]:
    return {family: family_dirs[family] for family in FAMILIES}


def _lora_model(folder: Path) -> LoraModel:
    loaded = load_model(str(folder))
    return LoraModel(loaded.model, loaded.name)


def _add_adapters(lora: LoraModel) -> None:
    """a: attention + MLP, rank 4 (expert rank 2); b: MLP only, rank 6, expert rank 3, another scale;
    c: attention only (no expert LoRA: its tokens see the base experts). Every lora_B random, nonzero."""
    lora.add("a", AdapterSpec(rank=4, alpha=8, targets=lora.group_targets(attn=True, mlp=True)), seed=1)
    lora.add("b", AdapterSpec(rank=6, alpha=3, targets=lora.group_targets(mlp=True), expert_rank=3), seed=2)
    lora.add("c", AdapterSpec(rank=2, alpha=4, targets=lora.group_targets(attn=True)), seed=3)
    assert lora.adapters["a"].spec.expert_rank == 2 and lora.adapters["c"].spec.expert_rank == 0
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for adapter in lora.adapters.values():
            for name, p in adapter.params.items():
                if ".lora_B." in name:
                    p.normal_(0, 0.1, generator=generator)


def _experts_out(wrapper, family, lora, owners, token_keys, x, idx, weights, reference: bool):
    """The experts' output on ``x``: the per-token reference, or the wrapper with rows routed to their owners."""
    if reference:
        return reference_experts(wrapper, family, lora, token_keys, x, idx, weights)
    routing = Routing(_groups(owners))
    routing.batch_rows = len(owners)
    with lora.router.route(routing):
        return wrapper(x, idx, weights)


def _out_and_grads(out, x, probe, mask, params: dict):
    """(output, d loss / d x, d loss / d each param) for loss = sum(out * probe * mask); zeros where unused."""
    grads = torch.autograd.grad((out * probe * mask).sum(), [x, *params.values()], allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, [x, *params.values()])]
    return out.detach(), grads[0], dict(zip(params, grads[1:]))


def _groups(owners: list[str | None]) -> list[tuple[str, torch.Tensor]]:
    keys = list(dict.fromkeys(k for k in owners if k is not None))
    return [(k, torch.tensor([r for r, o in enumerate(owners) if o == k])) for k in keys]


# ---- the reference --------------------------------------------------------------------------------


def _expert_factors(weights, projection: str, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s (A (r, in), B (out, r)) straight from peft's ParamWrapper layout."""
    a, b = getattr(weights, f"{projection}_A"), getattr(weights, f"{projection}_B")
    r, experts = weights.rank, weights.num_experts
    return a[expert * r:(expert + 1) * r], b[:, expert::experts]


def _project(base, layout, projection: str, expert: int, x: torch.Tensor, lora, scale: float) -> torch.Tensor:
    name = layout.gate_up if projection == "gate_up" else layout.down
    weight = getattr(base, name)[expert]
    y = x @ weight if layout.transposed else weight @ x
    bias_name = layout.gate_up_bias if projection == "gate_up" else layout.down_bias
    if bias_name:
        y = y + getattr(base, bias_name)[expert]
    if lora is not None:
        a, b = _expert_factors(lora, projection, expert)
        y = y + scale * (b @ (a @ x))
    return y


def _glu(base, family: str, h: torch.Tensor) -> torch.Tensor:
    if family == "gpt_oss":  # interleaved gate/up, clamped, (up + 1) * gate * sigmoid(alpha * gate)
        gate, up = h[0::2], h[1::2]
        gate = gate.clamp(max=base.limit)
        up = up.clamp(min=-base.limit, max=base.limit)
        return (up + 1) * gate * torch.sigmoid(base.alpha * gate)
    gate, up = h[: h.shape[0] // 2], h[h.shape[0] // 2:]
    return F.silu(gate) * up


def reference_experts(wrapper, family: str, lora: LoraModel, token_keys: list[str | None], hidden: torch.Tensor,
                      top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' output, token by token, expert by expert (``token_keys``: each token's adapter)."""
    base, layout = wrapper.base, wrapper.layout
    rows = []
    for t in range(hidden.shape[0]):
        key = token_keys[t]
        weights = wrapper.adapters.get(key) if key is not None else None
        scale = lora.adapters[key].spec.alpha / lora.adapters[key].spec.expert_rank if weights is not None else 0.0
        acc = torch.zeros_like(hidden[t])
        for k in range(top_k_index.shape[1]):
            e = int(top_k_index[t, k])
            h = _project(base, layout, "gate_up", e, hidden[t], weights, scale)
            y = _project(base, layout, "down", e, _glu(base, family, h), weights, scale)
            acc = acc + top_k_weights[t, k] * y
        rows.append(acc)
    return torch.stack(rows)


# ---- model-level passes ---------------------------------------------------------------------------


def _params(lora: LoraModel) -> dict[str, torch.nn.Parameter]:
    return {f"{key}:{name}": p for key, adapter in lora.adapters.items() for name, p in adapter.params.items()}


def _run(lora: LoraModel, family: str, ids, targets, row_weight, reference: bool, owners=OWNERS):
    """Logits, loss and every adapter parameter's gradient (zeros where autograd has none) of one routed
    pass, through Temper's experts or the reference; also each experts layer's router choice."""
    chosen: dict[str, torch.Tensor] = {}
    hooks = [w.register_forward_pre_hook(lambda m, args, path=path: chosen.__setitem__(path, args[1].clone()))
             for path, w in lora.experts.items()]
    token_keys = [owners[t // ids.shape[1]] for t in range(ids.numel())]
    if reference:
        for w in lora.experts.values():
            w.forward = (lambda hidden, idx, wts, w=w: reference_experts(w, family, lora, token_keys, hidden, idx, wts))
    try:
        with lora.route(_groups(owners)):
            logits = lora.model(ids).logits
    finally:
        for h in hooks:
            h.remove()
        for w in lora.experts.values():
            w.__dict__.pop("forward", None)
    logprobs = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    loss = -(logprobs * row_weight[:, None]).sum() / ids.numel()
    params = _params(lora)
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    grads = {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(params.items(), grads)}
    return logits.detach(), loss.detach(), grads, chosen


def _batch(vocab: int, seed: int = 5):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randint(0, vocab, (ROWS, SEQ), generator=generator),
            torch.randint(0, vocab, (ROWS, SEQ), generator=generator))


def _assert_grads_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _expert_grad(grads: dict, lora: LoraModel, key: str, path: str, expert: int) -> list[torch.Tensor]:
    """The gradient slices of expert ``expert`` of adapter ``key`` in experts layer ``path`` (A rows, B columns)."""
    weights = lora.experts[path].adapters[key]
    by_param = {id(p): n for n, p in lora.adapters[key].params.items()}
    out = []
    for projection in ("gate_up", "down"):
        a, b = getattr(weights, f"{projection}_A"), getattr(weights, f"{projection}_B")
        r, experts = weights.rank, weights.num_experts
        out.append(grads[f"{key}:{by_param[id(a)]}"][expert * r:(expert + 1) * r])
        out.append(grads[f"{key}:{by_param[id(b)]}"][:, expert::experts])
    return out


def _check_unseen_experts(lora: LoraModel, grads: dict, chosen: dict, owners=OWNERS, row_weight=None) -> int:
    """Experts an adapter's (loss-carrying) tokens never reach get exactly zero gradient; those they reach
    get some. Returns how many (adapter, layer, expert) triples were unseen."""
    unseen = 0
    for path, idx in chosen.items():
        idx = idx.view(ROWS, SEQ, -1)
        for key in lora.experts[path].adapters:
            rows = [r for r, o in enumerate(owners) if o == key and (row_weight is None or row_weight[r] != 0)]
            seen = set(idx[rows].flatten().tolist())
            for e in range(lora.experts[path].num_experts):
                slices = _expert_grad(grads, lora, key, path, e)
                if e in seen:
                    assert any(bool(s.abs().sum() > 0) for s in slices), (key, path, e)
                else:
                    unseen += 1
                    assert all(bool((s == 0).all()) for s in slices), (key, path, e)
    return unseen


@pytest.mark.parametrize("family", FAMILIES)
def test_routed_logits_loss_and_every_lora_gradient_match_the_reference(folders, family):
    lora = _lora_model(folders[family])
    _add_adapters(lora)
    ids, targets = _batch(lora.model.config.vocab_size)
    ones = torch.ones(ROWS)
    logits, loss, grads, chosen = _run(lora, family, ids, targets, ones, reference=False)
    ref_logits, ref_loss, ref_grads, ref_chosen = _run(lora, family, ids, targets, ones, reference=True)
    assert chosen.keys() == ref_chosen.keys() == lora.experts.keys()
    assert all(torch.equal(chosen[p], ref_chosen[p]) for p in chosen)  # the same router decisions
    torch.testing.assert_close(logits, ref_logits, **TOL)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    _assert_grads_close(grads, ref_grads)
    _check_unseen_experts(lora, grads, chosen)
    # every expert-LoRA parameter of a and b gets a gradient (the check has teeth), c has none
    for name, g in grads.items():
        if ".experts." in name:
            assert name.split(":")[0] in ("a", "b") and g.abs().sum() > 0, name
    # the row without adapter is the base model; b (MLP only: on these families only expert LoRA, plus the
    # shared/dense MLP on deepseek_v3) changes its rows
    with torch.no_grad():
        base = lora.model(ids).logits
    torch.testing.assert_close(logits[2], base[2], **TOL)
    torch.testing.assert_close(ref_logits[2], base[2], **TOL)
    for row, owner in enumerate(OWNERS):
        if owner is not None:
            assert (logits[row] - base[row]).abs().max() > 1e-3, (row, owner)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_land_only_in_the_adapter_whose_rows_carry_loss(folders, family):
    lora = _lora_model(folders[family])
    _add_adapters(lora)
    ids, targets = _batch(lora.model.config.vocab_size, seed=6)
    only_a = torch.tensor([1.0 if o == "a" else 0.0 for o in OWNERS])
    _, _, grads, chosen = _run(lora, family, ids, targets, only_a, reference=False)
    _, _, ref_grads, _ = _run(lora, family, ids, targets, only_a, reference=True)
    _assert_grads_close(grads, ref_grads)
    for name, g in grads.items():
        key = name.split(":")[0]
        if key == "a":
            assert g.abs().sum() > 0, name
        else:
            assert torch.count_nonzero(g) == 0, name
    _check_unseen_experts(lora, grads, chosen, row_weight=only_a)


def _routers(lora: LoraModel) -> list[torch.nn.Module]:
    blocks = [lora.model.get_submodule(path.rsplit(".", 1)[0]) for path in lora.experts]
    return [getattr(block, "router", None) or block.gate for block in blocks]


@pytest.mark.parametrize("family", FAMILIES)
def test_tied_router_logits_pick_the_same_experts_and_unreached_experts_get_zero_gradient(folders, family):
    lora = _lora_model(folders[family])
    _add_adapters(lora)
    with torch.no_grad():  # every router logit equal: top-k breaks a full tie
        for router in _routers(lora):
            for p in router.parameters():
                p.zero_()
    ids, targets = _batch(lora.model.config.vocab_size, seed=7)
    ones = torch.ones(ROWS)
    logits, loss, grads, chosen = _run(lora, family, ids, targets, ones, reference=False)
    ref_logits, ref_loss, ref_grads, ref_chosen = _run(lora, family, ids, targets, ones, reference=True)
    for path, idx in chosen.items():
        assert torch.equal(idx, ref_chosen[path])
        assert (idx == idx[0]).all()  # a full tie: every token the same experts, in both paths
    torch.testing.assert_close(logits, ref_logits, **TOL)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    _assert_grads_close(grads, ref_grads)
    # top-2 of 8 for every token: 6 experts per layer reached by nobody, for both expert adapters
    assert _check_unseen_experts(lora, grads, chosen) == 2 * 6 * len(lora.experts)


# ---- layer level: router outputs chosen by the test ----------------------------------------------


def _pick(generator, allowed: list[int], tokens: int, top_k: int) -> torch.Tensor:
    return torch.stack([torch.tensor(allowed)[torch.randperm(len(allowed), generator=generator)[:top_k]]
                        for _ in range(tokens)])


@pytest.mark.parametrize("path", ["grouped", "per-expert", "one-chunk", "chunked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_layer_with_chosen_routing_matches_the_reference(folders, family, path, monkeypatch):
    """a's tokens reach only experts 0-3, b's only 2-7, a2's (a's bucket) only 5 and 6; a row without adapter."""
    # grouped_mm per (expert, adapter) pair or per expert (a and a2 side by side, masked), or its fallback:
    # every pair padded to the longest, or a chunk for each slice length (PAD_SLACK 1)
    monkeypatch.setattr(experts_module, "SMALL_SLICE", 10**9 if path == "per-expert" else 0)
    if path not in ("grouped", "per-expert"):
        monkeypatch.setitem(grouped_matmul.SETTINGS, "enabled", False)
        monkeypatch.setattr(experts_module, "PAD_SLACK", 10**9 if path == "one-chunk" else 1.0)
    lora = _lora_model(folders[family])
    _add_adapters(lora)
    lora.add("a2", AdapterSpec(rank=4, alpha=8, targets=lora.group_targets(mlp=True)), seed=4)
    with torch.no_grad():
        for name, p in lora.adapters["a2"].params.items():
            if ".lora_B." in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(12))
    path_name, wrapper = next(iter(lora.experts.items()))
    owners = ["a", "b", None, "a2", "a"]
    rows, seq, top_k = len(owners), 7, lora.top_k
    tokens = rows * seq
    generator = torch.Generator().manual_seed(13)
    allowed = {"a": [0, 1, 2, 3], "b": [2, 3, 4, 5, 6, 7], "a2": [5, 6], None: list(range(8))}
    idx = torch.cat([_pick(generator, allowed[o], seq, top_k) for o in owners])
    weights = torch.rand(tokens, top_k, generator=generator) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    hidden = torch.randn(tokens, wrapper.shapes["gate_up"][0], generator=generator)
    if family == "gpt_oss":  # a clamp limit the tiny model's activations reach: both sides of it run
        monkeypatch.setattr(wrapper.base, "limit", 0.2)
    probe = torch.randn(tokens, hidden.shape[1], generator=generator)
    token_keys = [owners[t // seq] for t in range(tokens)]
    params = {n: p for key in ("a", "b", "a2") for n, p in
              ((f"{key}:{n}", p) for n, p in lora.adapters[key].params.items()) if f".{path_name}." in n}

    def run(reference: bool, weight_rows=None):
        x = hidden.clone().requires_grad_(True)
        out = _experts_out(wrapper, family, lora, owners, token_keys, x, idx, weights, reference)
        mask = torch.ones(tokens, 1) if weight_rows is None else torch.tensor(
            [[1.0] if token_keys[t] in weight_rows else [0.0] for t in range(tokens)])
        return _out_and_grads(out, x, probe, mask, params)

    out, x_grad, grads = run(False)
    ref_out, ref_x_grad, ref_grads = run(True)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(x_grad, ref_x_grad, **TOL)
    _assert_grads_close(grads, ref_grads)
    # the row without adapter is the base experts module (transformers' own implementation)
    with torch.no_grad():
        base = wrapper.base(hidden, idx, weights)
    torch.testing.assert_close(out[2 * seq:3 * seq], base[2 * seq:3 * seq], **TOL)
    # exactly zero gradient on the experts an adapter's tokens never reach, some on the others
    for key in ("a", "b", "a2"):
        for e in range(8):
            slices = _expert_grad(grads, lora, key, path_name, e)
            if e in allowed[key]:
                assert all(s.abs().sum() > 0 for s in slices), (key, e)
            else:
                assert all((s == 0).all() for s in slices), (key, e)
    # loss on a's tokens only: b's and a2's gradients are exactly zero, a's match the reference
    _, _, only_a = run(False, weight_rows={"a"})
    _, _, ref_only_a = run(True, weight_rows={"a"})
    _assert_grads_close(only_a, ref_only_a)
    for name, g in only_a.items():
        assert (g.abs().sum() > 0) if name.startswith("a:") else torch.count_nonzero(g) == 0, name


@pytest.mark.parametrize("low_width", [4, 64])
def test_per_expert_grouping_of_small_slices_matches_the_plain_loop(folders, low_width, monkeypatch):
    """Small (expert, adapter) slices run one group per expert and span of adapters (``SMALL_SLICE``,
    ``LOW_WIDTH``): five adapters of one bucket with 1 to 3 rows each (LOW_WIDTH 4: spans of two, the
    last one padded; 64: all five side by side) and a row without adapter equal the plain per-token,
    per-expert loop, forward, input gradient and every adapter's gradients; loss on c's rows only leaves
    every other adapter's gradients exactly zero."""
    monkeypatch.setattr(experts_module, "SMALL_SLICE", 10**9)
    monkeypatch.setattr(experts_module, "LOW_WIDTH", low_width)
    used = []
    original = experts_module._Bucket.expert_deltas

    def spy(self, *args):
        used.append(self.span)
        return original(self, *args)

    monkeypatch.setattr(experts_module._Bucket, "expert_deltas", spy)
    family = "qwen3_moe"
    lora = _lora_model(folders[family])
    keys = ["a", "b", "c", "d", "e"]
    generator = torch.Generator().manual_seed(21)
    for i, key in enumerate(keys):
        lora.add(key, AdapterSpec(rank=4, alpha=8, targets=lora.group_targets(mlp=True)), seed=30 + i)
        with torch.no_grad():
            for name, p in lora.adapters[key].params.items():
                if ".lora_B." in name:
                    p.normal_(0, 0.1, generator=generator)
    path_name, wrapper = next(iter(lora.experts.items()))
    owners = ["d", "a", "b", "b", None, "c", "e", "e", "e", "d", "c"]
    rows, seq, top_k = len(owners), 5, lora.top_k
    tokens = rows * seq
    idx = torch.stack([torch.randperm(8, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    hidden = torch.randn(tokens, wrapper.shapes["gate_up"][0], generator=generator)
    probe = torch.randn(tokens, hidden.shape[1], generator=generator)
    token_keys = [owners[t // seq] for t in range(tokens)]
    params = {n: p for key in keys for n, p in
              ((f"{key}:{n}", p) for n, p in lora.adapters[key].params.items()) if f".{path_name}." in n}

    def run(reference: bool, only=None):
        x = hidden.clone().requires_grad_(True)
        out = _experts_out(wrapper, family, lora, owners, token_keys, x, idx, weights, reference)
        mask = torch.tensor([[1.0] if only is None or token_keys[t] == only else [0.0] for t in range(tokens)])
        return _out_and_grads(out, x, probe, mask, params)

    out, x_grad, grads = run(False)
    assert used and set(used) == {2 if low_width == 4 else 5}
    ref_out, ref_x_grad, ref_grads = run(True)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(x_grad, ref_x_grad, **TOL)
    _assert_grads_close(grads, ref_grads)
    assert all(g.abs().sum() > 0 for g in grads.values())
    _, _, only_c = run(False, only="c")
    _, _, ref_only_c = run(True, only="c")
    _assert_grads_close(only_c, ref_only_c)
    for name, g in only_c.items():
        assert (g.abs().sum() > 0) if name.startswith("c:") else torch.count_nonzero(g) == 0, name
