"""The native top-k (conduit_rt.topk, conduit_topk) against torch on CPU and, under the gpu marker, CUDA.

Reference: a stable descending torch.sort, first k, sorted ascending. torch.sort puts NaN first
and keeps equal scores (-0.0 and +0.0 included) in index order, which is exactly the native order
(NaN above +inf, ties to the lower index). On inputs without ties the set also equals torch.topk's.
"""
from __future__ import annotations

import pytest
import torch

from conduit_rt import topk
from conduit_rt.errors import InvalidArgumentError
from conduit_rt.selection import top_k_indices


def reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    order = torch.sort(scores.cpu(), descending=True, stable=True).indices
    return torch.sort(order[:k]).values


def make_scores(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:
    if kind == "random":
        return torch.randn(n, generator=generator) * 50
    if kind == "ties":  # duplicate-heavy: four distinct values
        return torch.randint(0, 4, (n,), generator=generator).float() - 1.5
    if kind == "negative":
        return -torch.rand(n, generator=generator) - 1e-3
    if kind == "special":  # infinities, signed zeros, huge values
        pool = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 3e38, -3e38, 1.0, -1.0])
        return pool[torch.randint(0, pool.numel(), (n,), generator=generator)]
    raise ValueError(kind)


SIZES = [1, 2, 33, 1000, 4097, 100_000, 300_000]
KINDS = ["random", "ties", "negative", "special"]


def k_values(n: int) -> list[int]:
    return sorted({1, n // 10, max(n - 1, 0), n})


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_topk_equals_stable_sort_reference(device, n, kind):
    generator = torch.Generator().manual_seed(n + len(kind))
    scores = make_scores(kind, n, generator)
    on_device = scores.to(device)
    for k in k_values(n):
        got = topk.top_k_indices(on_device, k)
        assert got.device.type == torch.device(device).type and got.dtype == torch.long and got.shape == (k,)
        assert torch.equal(got.cpu(), reference(scores, k)), f"n={n} k={k} {kind}"


@pytest.mark.parametrize("n", [1000, 100_000])
def test_topk_set_equals_torch_topk_without_ties(device, n):
    scores = torch.randperm(n, generator=torch.Generator().manual_seed(7)).float() / n - 0.5  # distinct
    for k in k_values(n):
        got = set(topk.top_k_indices(scores.to(device), k).cpu().tolist())
        assert got == set(torch.topk(scores, k).indices.tolist())


def test_topk_nan_ranks_above_inf(device):
    scores = torch.tensor([1.0, float("nan"), float("inf"), -float("nan"), 5.0, float("nan"), -float("inf")])
    on_device = scores.to(device)
    assert topk.top_k_indices(on_device, 2).cpu().tolist() == [1, 3]  # NaNs first, lower index first
    assert topk.top_k_indices(on_device, 4).cpu().tolist() == [1, 2, 3, 5]
    assert topk.top_k_indices(on_device, 5).cpu().tolist() == [1, 2, 3, 4, 5]
    assert torch.equal(topk.top_k_indices(on_device, 6).cpu(), reference(scores, 6))


def test_topk_all_equal_takes_lowest_indices(device):
    scores = torch.full((5000,), 0.25, device=device)
    assert torch.equal(topk.top_k_indices(scores, 777).cpu(), torch.arange(777))


def test_topk_reads_other_float_dtypes_and_views(device):
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(2000, generator=generator)
    strided = base.to(device)[::2]
    assert torch.equal(topk.top_k_indices(strided, 100).cpu(), reference(base[::2], 100))
    half = base.half()
    assert torch.equal(topk.top_k_indices(half.to(device), 100).cpu(), reference(half.float(), 100))


@pytest.mark.parametrize("k", [-1, 11])
def test_topk_k_out_of_range_is_a_typed_error(device, k):
    with pytest.raises(InvalidArgumentError):
        topk.top_k_indices(torch.rand(10, device=device), k)


def test_topk_rejects_non_vectors(device):
    with pytest.raises(InvalidArgumentError):
        topk.top_k_indices(torch.rand(4, 4, device=device), 2)


def test_topk_k_zero_and_empty(device):
    assert topk.top_k_indices(torch.rand(10, device=device), 0).numel() == 0
    assert topk.top_k_indices(torch.zeros(0, device=device), 0).numel() == 0


def test_refresh_top_k_indices_uses_native_order(device):
    scores = torch.tensor([0.5, 2.0, 0.5, 2.0, 0.5], device=device)
    assert top_k_indices(scores, 3).cpu().tolist() == [0, 1, 3]
    assert top_k_indices(scores, 0).numel() == 0
    with pytest.raises(InvalidArgumentError):
        top_k_indices(scores, 6)


def test_native_topk_status_for_bad_arguments():
    from conduit_rt import native

    ffi, lib = native.load()
    scores = torch.rand(16)
    out = torch.empty(4, dtype=torch.int32)
    ws = torch.zeros(lib.conduit_topk_workspace_bytes(lib.CONDUIT_BACKEND_CPU, 16), dtype=torch.uint8)

    def call(k: int, ws_bytes: int, index_type: int = 0) -> int:
        return lib.conduit_topk(lib.CONDUIT_BACKEND_CPU, 0, ffi.cast("const float *", scores.data_ptr()), 16, k,
                                index_type, ffi.cast("void *", out.data_ptr()), ffi.cast("void *", ws.data_ptr()),
                                ws_bytes, ffi.NULL)

    assert call(4, ws.numel()) == lib.CONDUIT_OK
    assert torch.equal(out.long(), reference(scores, 4))
    assert call(17, ws.numel()) == lib.CONDUIT_ERR_INVALID_ARGUMENT
    assert "k = 17" in native.last_error()
    assert call(-1, ws.numel()) == lib.CONDUIT_ERR_INVALID_ARGUMENT
    assert call(4, ws.numel() - 1) == lib.CONDUIT_ERR_INVALID_ARGUMENT
    assert call(4, ws.numel(), 7) == lib.CONDUIT_ERR_INVALID_ARGUMENT
