"""Which fp32 CPU primitives are batch-invariant, bit for bit? (issue 23 groundwork)

Measures, with torch.set_num_threads fixed to 1 and to 2, whether each primitive gives
torch.equal results when the batch around a row changes, and the max abs difference when
it does not. Shapes follow SmolLM2-135M: hidden K=576, MLP N=1536, head_dim 64, vocab 49152.

    python benchmarks/batch_invariance.py          # < 2 minutes on 2 cores

Prints a table and writes benchmarks/results/batch_invariance.json.
"""

from __future__ import annotations

import json
import math
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

K, N, VOCAB, HEAD_DIM, T_SEQ, HEADS = 576, 1536, 49152, 64, 128, 9
MS = (1, 3, 16, 17, 64, 128)
ROW_TILES = (16, 32)
KEY_BLOCK, QUERY_TILE = 32, 16
THREADS = (1, 2)
OUT = Path(__file__).parent / "results" / "batch_invariance.json"


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float]:
    return bool(torch.equal(a, b)), float((a - b).abs().max())


def merge(results: list[tuple[bool, float]]) -> dict:
    return {"bit_identical": all(r[0] for r in results), "max_abs_diff": max(r[1] for r in results)}


# ---------------------------------------------------------------- linear layers

def tiled_linear(x: torch.Tensor, w_t: torch.Tensor, tile: int) -> torch.Tensor:
    """x[M,K] @ w_t[K,N] as a loop of identical [tile,K] @ [K,N] GEMMs (rows zero-padded)."""
    m = x.shape[0]
    padded = torch.zeros(math.ceil(m / tile) * tile, x.shape[1], dtype=x.dtype)
    padded[:m] = x
    return torch.cat([padded[i:i + tile] @ w_t for i in range(0, padded.shape[0], tile)])[:m]


def tiled_logsumexp(logits: torch.Tensor, tile: int) -> torch.Tensor:
    """logsumexp over the vocab, always on [tile,V] row tiles (zero-padded)."""
    m = logits.shape[0]
    padded = torch.zeros(math.ceil(m / tile) * tile, logits.shape[1], dtype=logits.dtype)
    padded[:m] = logits
    return torch.cat([torch.logsumexp(padded[i:i + tile], -1) for i in range(0, padded.shape[0], tile)])[:m]


def tiled_linear_bmm(x: torch.Tensor, w_t: torch.Tensor, tile: int) -> torch.Tensor:
    """Same tiles, as one bmm over a stride-0 expanded weight."""
    m = x.shape[0]
    padded = torch.zeros(math.ceil(m / tile) * tile, x.shape[1], dtype=x.dtype)
    padded[:m] = x
    tiles = padded.view(-1, tile, x.shape[1])
    return torch.bmm(tiles, w_t.expand(tiles.shape[0], *w_t.shape)).reshape(-1, w_t.shape[1])[:m]


def matmul_checks(x: torch.Tensor, w_t: torch.Tensor, w: torch.Tensor) -> list[dict]:
    rows: list[dict] = []
    solo = torch.cat([x[i:i + 1] @ w_t for i in range(x.shape[0])])
    full = x @ w_t
    lin_solo = torch.cat([F.linear(x[i:i + 1], w) for i in range(x.shape[0])])
    for m in MS:
        out = x[:m] @ w_t
        rows.append({"test": "matmul row vs M=1", "case": f"M={m}", **merge([compare(out, solo[:m])])})
        rows.append({"test": "matmul row vs M=128", "case": f"M={m}", **merge([compare(out, full[:m])])})
        lin = F.linear(x[:m], w)
        rows.append({"test": "F.linear vs matmul", "case": f"M={m}", **merge([compare(lin, out)])})
        rows.append({"test": "F.linear row vs M=1", "case": f"M={m}", **merge([compare(lin, lin_solo[:m])])})
    for tile in ROW_TILES:
        for name, fn in (("tiled mm", tiled_linear), ("tiled bmm", tiled_linear_bmm)):
            ref = fn(x, w_t, tile)  # M=128
            per_m = [compare(fn(x[:m], w_t, tile), ref[:m]) for m in MS]
            rows.append({"test": f"{name} row, M in {MS} vs M=128", "case": f"tile={tile}", **merge(per_m)})
        # One row moved to every position inside a tile whose other rows hold different data.
        tile_ref = x[:tile] @ w_t
        moved = []
        for row in range(4):
            for pos in range(tile):
                block = torch.randn(tile, K) if pos % 2 else torch.zeros(tile, K)
                block[pos] = x[row]
                moved.append(compare((block @ w_t)[pos], tile_ref[row]))
        rows.append({"test": "row at any position in a [tile,K] GEMM", "case": f"tile={tile}", **merge(moved)})
    return rows


# ---------------------------------------------------------------- attention

def explicit_attention(q, k, v) -> torch.Tensor:
    t = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def blocked_attention_tile(q_tile, q_pos, k_cache, v_cache, n_keys: int) -> torch.Tensor:
    """Queries q_tile[H,QUERY_TILE,d] at positions q_pos over keys [0,n_keys) of [H,L,d] caches, in
    fixed blocks of KEY_BLOCK keys (zero-padded, masked), online softmax in block order. Every GEMM
    and row reduction has the same shape whether this is a one-token decode or a full forward."""
    h, _, d = q_tile.shape
    scale = 1.0 / math.sqrt(d)
    m = torch.full((h, QUERY_TILE, 1), float("-inf"))
    denom = torch.zeros(h, QUERY_TILE, 1)
    acc = torch.zeros(h, QUERY_TILE, d)
    last_needed = int(q_pos.max()) + 1
    for start in range(0, min(n_keys, last_needed), KEY_BLOCK):
        kb = torch.zeros(h, KEY_BLOCK, d)
        vb = torch.zeros(h, KEY_BLOCK, d)
        stop = min(start + KEY_BLOCK, n_keys)
        kb[:, : stop - start] = k_cache[:, start:stop]
        vb[:, : stop - start] = v_cache[:, start:stop]
        s = (q_tile @ kb.transpose(1, 2)) * scale
        key_pos = torch.arange(start, start + KEY_BLOCK)
        s = s.masked_fill((key_pos[None, :] > q_pos[:, None]) | (key_pos[None, :] >= n_keys), float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new)
        denom = denom * alpha + p.sum(dim=-1, keepdim=True)
        acc = acc * alpha + p @ vb
        m = m_new
    return acc / denom


def blocked_full(q, k, v) -> torch.Tensor:
    t = q.shape[1]
    outs = []
    for r0 in range(0, t, QUERY_TILE):
        pos = torch.arange(r0, r0 + QUERY_TILE)
        outs.append(blocked_attention_tile(q[:, r0:r0 + QUERY_TILE], pos, k, v, t))
    return torch.cat(outs, dim=1)


def blocked_decode(q_row, t: int, k_cache, v_cache, aligned: bool) -> torch.Tensor:
    """Token t (keys 0..t in the cache): its query sits at row t % QUERY_TILE (aligned, as in the
    full forward) or row 0 of an otherwise zero tile."""
    row = t % QUERY_TILE if aligned else 0
    tile = torch.zeros(q_row.shape[0], QUERY_TILE, q_row.shape[1])
    tile[:, row] = q_row
    pos = torch.full((QUERY_TILE,), t)
    return blocked_attention_tile(tile, pos, k_cache[:, : t + 1], v_cache[:, : t + 1], t + 1)[:, row]


def attention_checks(q, k, v) -> list[dict]:
    rows: list[dict] = []
    t_len = q.shape[1]
    s = (q[0] @ k[0].T) / math.sqrt(HEAD_DIM)
    masked = s.masked_fill(torch.ones(t_len, t_len, dtype=torch.bool).triu(1), float("-inf"))
    soft_all = torch.softmax(masked, dim=-1)
    lse_all = torch.logsumexp(masked, dim=-1)
    sm_dec, sm_row, lse_dec, lse_row = [], [], [], []
    for t in range(t_len):
        sm_dec.append(compare(torch.softmax(s[t, : t + 1], -1), soft_all[t, : t + 1]))
        sm_row.append(compare(torch.softmax(masked[t], -1), soft_all[t]))
        lse_dec.append(compare(torch.logsumexp(s[t, : t + 1], -1), lse_all[t]))
        lse_row.append(compare(torch.logsumexp(masked[t], -1), lse_all[t]))
    rows.append({"test": "softmax over t+1 keys vs masked full [T,T]", "case": "T=128 H=9", **merge(sm_dec)})
    rows.append({"test": "softmax masked row alone vs in [T,T]", "case": "T=128 H=9", **merge(sm_row)})
    rows.append({"test": "logsumexp over t+1 keys vs masked full", "case": "T=128 H=9", **merge(lse_dec)})
    rows.append({"test": "logsumexp masked row alone vs in [T,T]", "case": "T=128 H=9", **merge(lse_row)})

    logits = torch.randn(128, VOCAB) * 3
    lse_v = torch.logsumexp(logits, -1)
    rows.append({"test": "vocab logsumexp row alone vs M=128", "case": f"V={VOCAB}",
                 **merge([compare(torch.logsumexp(logits[i:i + 1], -1), lse_v[i:i + 1]) for i in range(128)])})
    tiled_lse = tiled_logsumexp(logits, 16)
    rows.append({"test": "vocab logsumexp on fixed [16,V] tiles, M vs 128", "case": f"V={VOCAB}",
                 **merge([compare(tiled_logsumexp(logits[:m], 16), tiled_lse[:m]) for m in MS])})
    lsm = torch.log_softmax(logits, -1)
    rows.append({"test": "log_softmax vs logits - logsumexp", "case": f"V={VOCAB}",
                 **merge([compare(lsm, logits - lse_v[:, None])])})

    explicit = explicit_attention(q, k, v)
    q4, k4, v4 = (t[None] for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        sdpa_math = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)[0]
        dec_math = [compare(F.scaled_dot_product_attention(q4[:, :, t:t + 1], k4[:, :, : t + 1],
                                                           v4[:, :, : t + 1])[0, :, 0], sdpa_math[:, t])
                    for t in range(t_len)]
    sdpa_default = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)[0]
    dec_default = [compare(F.scaled_dot_product_attention(q4[:, :, t:t + 1], k4[:, :, : t + 1],
                                                          v4[:, :, : t + 1])[0, :, 0], sdpa_default[:, t])
                   for t in range(t_len)]
    dec_explicit = [compare(explicit_attention(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1])[:, t], explicit[:, t])
                    for t in range(t_len)]
    rows.append({"test": "SDPA(math) causal vs explicit attention", "case": "T=128 H=9", **merge([compare(sdpa_math, explicit)])})
    rows.append({"test": "SDPA(math) decode t vs full row t", "case": "T=128 H=9", **merge(dec_math)})
    rows.append({"test": "SDPA(default) decode t vs full row t", "case": "T=128 H=9", **merge(dec_default)})
    rows.append({"test": "explicit attn prefix t+1 vs full row t", "case": "T=128 H=9", **merge(dec_explicit)})

    blocked = blocked_full(q, k, v)
    rows.append({"test": "blocked attn (32-key blocks) vs explicit", "case": "T=128 H=9", **merge([compare(blocked, explicit)])})
    for aligned in (True, False):
        dec = [compare(blocked_decode(q[:, t], t, k, v, aligned), blocked[:, t]) for t in range(t_len)]
        where = "row t%16" if aligned else "row 0"
        rows.append({"test": f"blocked attn decode ({where}) vs full forward", "case": "T=128 H=9", **merge(dec)})
    return rows


# ---------------------------------------------------------------- timings

def best_time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def timings(x, w_t, w, q, k, v) -> list[dict]:
    rows = []
    for m in (1, 16, 128):
        reps = 200 if m < 128 else 50
        plain = best_time(lambda: F.linear(x[:m], w), reps)
        for tile in ROW_TILES:
            tiled = best_time(lambda: tiled_linear(x[:m], w_t, tile), reps)
            rows.append({"op": "linear 576->1536 mm", "case": f"M={m} tile={tile}", "default_us": plain * 1e6,
                         "invariant_us": tiled * 1e6, "ratio": tiled / plain})
            tiled_b = best_time(lambda: tiled_linear_bmm(x[:m], w_t, tile), reps)
            rows.append({"op": "linear 576->1536 bmm", "case": f"M={m} tile={tile}", "default_us": plain * 1e6,
                         "invariant_us": tiled_b * 1e6, "ratio": tiled_b / plain})
    q4, k4, v4 = (t[None] for t in (q, k, v))
    full_def = best_time(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True), 50)
    full_blk = best_time(lambda: blocked_full(q, k, v), 10)
    rows.append({"op": "attention full forward", "case": "T=128 H=9", "default_us": full_def * 1e6,
                 "invariant_us": full_blk * 1e6, "ratio": full_blk / full_def})
    t = T_SEQ - 1
    dec_def = best_time(lambda: F.scaled_dot_product_attention(q4[:, :, t:t + 1], k4, v4), 200)
    dec_blk = best_time(lambda: blocked_decode(q[:, t], t, k, v, True), 50)
    rows.append({"op": "attention decode step", "case": "t=127 H=9", "default_us": dec_def * 1e6,
                 "invariant_us": dec_blk * 1e6, "ratio": dec_blk / dec_def})
    return rows


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(128, K)
    w = torch.randn(N, K) / math.sqrt(K)  # nn.Linear layout [out, in]
    w_t = w.T.contiguous()
    q, k, v = (torch.randn(HEADS, T_SEQ, HEAD_DIM) for _ in range(3))
    checks: list[dict] = []
    timing_rows: list[dict] = []
    per_thread_out: dict[int, torch.Tensor] = {}
    for n_threads in tqdm(THREADS, desc="thread counts"):
        torch.set_num_threads(n_threads)
        steps = tqdm(total=3, desc=f"threads={n_threads}", leave=False)
        for row in matmul_checks(x, w_t, w):
            checks.append({"threads": n_threads, **row})
        steps.update()
        for row in attention_checks(q, k, v):
            checks.append({"threads": n_threads, **row})
        steps.update()
        for row in timings(x, w_t, w, q, k, v):
            timing_rows.append({"threads": n_threads, **row})
        steps.update()
        steps.close()
        per_thread_out[n_threads] = torch.cat([tiled_linear(x, w_t, 16).flatten(), F.linear(x, w).flatten(),
                                               blocked_full(q, k, v).flatten()])
    cross = compare(per_thread_out[1], per_thread_out[2])
    checks.append({"threads": "1 vs 2", "test": "tiled linear + F.linear + blocked attn", "case": "same inputs",
                   "bit_identical": cross[0], "max_abs_diff": cross[1]})

    print(f"\n{'thr':>6}  {'test':<50} {'case':<12} {'equal':<6} max|diff|")
    for r in checks:
        print(f"{r['threads']!s:>6}  {r['test']:<50} {r['case']:<12} {'yes' if r['bit_identical'] else 'NO':<6} "
              f"{r['max_abs_diff']:.3g}")
    print(f"\n{'thr':>4}  {'op':<24} {'case':<16} {'default us':>11} {'invariant us':>13} {'ratio':>6}")
    for r in timing_rows:
        print(f"{r['threads']:>4}  {r['op']:<24} {r['case']:<16} {r['default_us']:>11.1f} {r['invariant_us']:>13.1f} "
              f"{r['ratio']:>6.2f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "config": torch.__config__.parallel_info().splitlines()[:6], "dtype": "float32",
        "shapes": {"K": K, "N": N, "vocab": VOCAB, "head_dim": HEAD_DIM, "T": T_SEQ,
                   "key_block": KEY_BLOCK, "query_tile": QUERY_TILE},
        "checks": checks, "timings": timing_rows}, indent=1))
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
