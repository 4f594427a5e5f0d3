"""CPU projections on torch's GEMM or a copy of the weights for another kernel (oneDNN's packed
layout, the weights transposed: models/layers/gemm.py) and the start-up choice between them
(engine/gemm_choice.py).

Oracles: fp64 torch for the products, HF transformers for a model on either copy, closed-form
arithmetic for the threshold and the kernel picked, a fake forward whose cost per kernel is
known for the measurement.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import load_hf, write_checkpoint
from model_runner import generate

from dspark_launch.engine.gemm_choice import from_rows, measure, pick_kernel
from dspark_launch.models.layers import PackPlan, dense, pack, pack_model, unpack_model
from dspark_launch.models.layers.gemm import KERNELS, NEVER
from dspark_launch.models.loader import load_model
from dspark_launch.parallel import override_parallel

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="torch without oneDNN")


@pytest.mark.parametrize("dtype,tol", [
    (torch.float32, 1e-5),
    pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
        not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bf16 on this CPU"))])
@pytest.mark.parametrize("rows", [0, 1, 3, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_matches_fp64(dtype, tol, rows, bias, kernel):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, 40, generator=g).to(dtype)
    want = x.double() @ weight.double().t() + (b.double() if bias else 0)
    plan = PackPlan()
    packed = pack(weight, plan, kernel)
    assert packed is not None and packed.kernel == kernel
    for plan.from_rows in (1, NEVER):
        got = dense(x, weight, b, packed)
        assert got.shape == (rows, 96) and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_copy_serves_rows_from_the_plans_count(kernel):
    """The copy is taken at the plan's row count and above, the plain weight below: after the
    plain weight changes, each row count follows the copy it reads."""
    weight = torch.randn(64, 32)
    plan = PackPlan(from_rows=4)
    packed = pack(weight, plan, kernel)
    old = weight.clone()
    weight.mul_(2.0)
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, 32)
        expect = old if rows >= 4 else weight
        torch.testing.assert_close(dense(x, weight, None, packed), x @ expect.t(),
                                   atol=1e-4, rtol=1e-4)
    x = torch.randn(32, 9).t()  # a transposed (non-contiguous) input
    torch.testing.assert_close(dense(x, weight, None, packed), x @ old.t(), atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("kernel", KERNELS)
def test_only_cpu_fp32_and_bf16_matrices_are_packed(kernel):
    assert pack(torch.randn(8, 8, dtype=torch.float16), PackPlan(), kernel) is None
    assert pack(torch.randn(8), PackPlan(), kernel) is None
    assert pack(torch.randn(8, 8), PackPlan(), kernel) is not None
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # oneDNN's own bf16 gate
    assert (pack(torch.randn(8, 8, dtype=torch.bfloat16), PackPlan(), kernel) is not None
            ) == bf16
    with pytest.raises(ValueError, match="GEMM kernel 'fast': expected one of"):
        pack(torch.randn(8, 8), PackPlan(), "fast")


@pytest.mark.parametrize("tied,kernel", [(False, "onednn"), (True, "onednn"),
                                         (True, "transposed")])
def test_packed_model_matches_hf(tmp_path, tied, kernel):
    """Every projection on its copy (embedding-tied LM head too): prefill logits and 24 greedy
    tokens as HF's; unpacked again, the model keeps no copy and still matches."""
    ckpt = write_checkpoint(tmp_path / "ckpt", arch="qwen3", num_kv_heads=2, tied=tied,
                            attention_bias=True)
    hf = load_hf(ckpt)
    prompts = [[5, 17, 99, 3, 42, 7, 8], [11], list(range(60, 73))]
    with override_parallel(1):
        model = load_model(ckpt, "float32")
        plan = PackPlan(from_rows=1)
        layers = 4 * model.config.num_hidden_layers + 1  # qkv, o, gate_up, down; LM head
        assert pack_model(model, plan, kernel) == layers
        tokens, prefill = generate(model, prompts, 24)
        unpack_model(model)
        assert all(getattr(m, "packed", None) is None for m in model.modules())
        again, _ = generate(model, prompts, 24)
    assert tokens == again
    for prompt, got, toks in zip(prompts, prefill, tokens):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            torch.testing.assert_close(got, hf(ids).logits[0], atol=1e-4, rtol=1e-4)
            want = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert toks == want.tolist()


@pytest.mark.parametrize("times,want", [
    ({1: (4.2, 4.5), 2: (4.8, 5.0), 4: (5.2, 4.5), 8: (5.6, 4.9), 64: (12.6, 11.6)}, 4),
    ({1: (4.0, 3.0), 2: (4.0, 3.0), 4: (4.0, 3.0)}, 1),
    ({1: (4.0, 3.0), 2: (4.0, 4.5), 4: (4.0, 3.0)}, 4),  # only a run up to the top counts
    ({1: (4.0, 3.0), 8: (4.0, 4.0)}, NEVER),  # the largest count must win too
    ({1: (4.0, 3.9), 8: (4.0, 3.9)}, NEVER),  # 2.5% faster: within the margin, a tie
    # Xeon's embedded target (ms, medians of 45 alternating forwards): a tie at 2 tokens
    # inside the run must not hand 1 token to the slower kernel.
    ({1: (3.80, 3.60), 2: (3.91, 3.93), 3: (3.97, 3.74), 4: (3.99, 3.71), 16: (5.79, 5.32),
      64: (11.10, 9.75)}, 1),
    # ... but a run is extended past a count the copy loses (within the margin) only where
    # the counts below make up for it: 1.25% - 2.5% < 0
    ({1: (4.0, 3.95), 2: (4.0, 4.1), 4: (4.0, 3.0)}, 4),
    ({1: (4.0, 3.8), 2: (4.0, 4.1), 4: (4.0, 3.0)}, 1),  # 5% - 2.5% > 0
    ({1: (4.0, 3.0), 2: (4.0, 4.0), 4: (4.0, 3.9), 8: (4.0, 3.0)}, 1),  # ties inside a run
])
def test_threshold_is_the_start_of_the_copys_most_saving_run(times, want):
    assert from_rows(times) == want


def test_measure_times_each_kernel_alternately_and_keeps_the_median():
    """A fake forward whose cost per kernel and count is known (the oracle), plus a stall and
    a lucky forward (a clock that read short) among the timed ones: the median of each is that
    cost (a minimum would keep the lucky one), and the forwards' number is fixed."""
    cost = {(n, packed): (1.0 + n) * (0.5 if packed and n >= 4 else 1.0)
            for n in (1, 4, 16) for packed in (False, True)}
    now = [0.0]
    calls: list[tuple[int, bool]] = []
    plan = PackPlan()
    repeats = 5
    per_count = 2 + 2 * repeats
    # At 4 tokens (calls per_count + 1 .. 2 x per_count; the first 2 warm up): the 2nd timed
    # torch forward stalls, the 3rd timed copy forward reads a quarter of its cost.
    odd = {per_count + 5: 50.0, per_count + 8: -0.75 * cost[4, True]}

    def run(n: int) -> None:
        packed = plan.from_rows <= n
        calls.append((n, packed))
        now[0] += cost[n, packed] + odd.get(len(calls), 0.0)

    times = measure(run, plan, [1, 4, 16], repeats=repeats, clock=lambda: now[0])
    assert len(calls) == 3 * per_count
    assert calls[2:per_count] == [(1, False), (1, True)] * repeats  # alternating after warm-up
    assert calls[per_count + 4] == (4, False) and calls[per_count + 7] == (4, True)
    assert times == {n: (cost[n, False], cost[n, True]) for n in (1, 4, 16)}
    assert from_rows(times) == 4


@pytest.mark.parametrize("times,want", [
    # Xeon's embedded target (ms): oneDNN never 3% faster, the transposed copy from 4 rows.
    ({"onednn": {1: (6.5, 6.3), 4: (6.8, 9.9), 64: (13.6, 18.3)},
      "transposed": {1: (6.5, 6.5), 4: (6.8, 6.3), 64: (13.6, 11.1)}}, ("transposed", 4)),
    # Both win from 4 rows: oneDNN saves (1 - 4/5) + (1 - 8/10) = 0.4, transposed 0.1 + 0.2.
    ({"onednn": {1: (4.0, 4.0), 4: (5.0, 4.0), 64: (10.0, 8.0)},
      "transposed": {1: (4.0, 4.0), 4: (5.0, 4.5), 64: (10.0, 8.0)}}, ("onednn", 4)),
    # Transposed wins from 1 row by a little (3 x 0.05), oneDNN from 64 by more (0.3).
    ({"onednn": {1: (4.0, 5.0), 4: (5.0, 5.5), 64: (10.0, 7.0)},
      "transposed": {1: (4.0, 3.8), 4: (5.0, 4.75), 64: (10.0, 9.5)}}, ("onednn", 64)),
    ({"onednn": {1: (4.0, 3.0)}, "transposed": {1: (4.0, 3.0)}}, ("onednn", 1)),  # tie: first
    ({"onednn": {1: (4.0, 3.99)}, "transposed": {1: (4.0, 4.5)}}, ("torch", NEVER)),
    ({}, ("torch", NEVER)),
])
def test_the_kernel_kept_is_the_one_whose_winning_run_saves_most(times, want):
    assert pick_kernel(times) == want


def test_a_shapes_first_call_is_booked_once_per_shape():
    """oneDNN makes a primitive per shape (rows, weight, bias): its first call is booked as
    compile (FirstShapes) once, whichever layer makes it, and returns the product; the other
    kernels and the plain path book nothing."""
    from dspark_launch.models.layers.gemm import FIRST_SHAPES

    g = torch.Generator().manual_seed(3)
    weight, b = torch.randn(48, 24, generator=g), torch.randn(48, generator=g)
    x = torch.randn(131, 24, generator=g)
    packed, twin = pack(weight, PackPlan(2), "onednn"), pack(weight.clone(), PackPlan(2))
    transposed = pack(weight, PackPlan(2), "transposed")
    shape = (48, 24, torch.float32)

    def booked(rows: int, bias: torch.Tensor | None, copy) -> set:
        before = set(FIRST_SHAPES.seen)
        out = dense(x[:rows], weight, bias, copy)
        want = x[:rows].double() @ weight.double().t() + (0 if bias is None else bias.double())
        assert torch.allclose(out.double(), want, atol=1e-4)
        return FIRST_SHAPES.seen - before

    assert booked(131, None, packed) == {(131, shape, True)}
    assert booked(131, None, twin) == set()  # another layer of the same shape
    assert booked(131, None, packed) == set()
    assert booked(131, b, packed) == {(131, shape, False)}
    assert booked(130, None, packed) == {(130, shape, True)}
    assert booked(1, None, packed) == set()  # under the plan's rows: torch's kernel
    assert booked(131, None, transposed) == set()
