"""Programmatic dependent launch of the Triton kernels (models.fused_triton).

Without a GPU: the switch (capability, ``CONDUIT_PDL``, the interpreter), and the kernels compiled
for sm_90 ahead of time, whose PTX must wait (``griddepcontrol.wait``) before reading anything but
weights and before writing, and hold no grid dependency control at all with PDL off. On a GPU: each
kernel with PDL equals itself without it, bit for bit, alone and chained in a captured CUDA graph
(an early read of an activation would read the previous replay's)."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")
from conduit_rt.models import fused_triton  # noqa: E402  (needs Triton)


@pytest.fixture
def fresh_switch():
    """pdl_enabled decided anew in the test and again after it (the environment it read is the test's)."""
    fused_triton.pdl_enabled.cache_clear()
    yield fused_triton.pdl_enabled
    fused_triton.pdl_enabled.cache_clear()


@pytest.mark.parametrize("capability,env,want", [
    ((9, 0), {}, True), ((10, 0), {}, True), ((8, 9), {}, False),
    ((9, 0), {"CONDUIT_PDL": "0"}, False), ((9, 0), {"CONDUIT_PDL": "1"}, True),
    ((9, 0), {"TRITON_INTERPRET": "1"}, False),
])
def test_pdl_is_on_from_hopper_unless_turned_off(monkeypatch, fresh_switch, capability, env, want):
    monkeypatch.delenv("CONDUIT_PDL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    assert fresh_switch(0) is (want and fused_triton._triton_has_pdl())


# --- the kernels compiled for sm_90 without a GPU -------------------------------------------------

_P, _I = "*bf16", "i32"
_KERNELS = {  # kernel, its runtime arguments' types, its constexprs (a 7B model's shapes), options
    **{name: (fused_triton._gemv_kernel,
              dict(x_ptr=_P, w_ptr=_P, bias_ptr=_P, out_ptr=_P, cos_ptr=_P, sin_ptr=_P, n_out=_I, n_in=_I,
                   n_rotating=_I, n_freq=_I, head_dim=_I),
              dict(HAS_BIAS=True, EPILOGUE=epilogue, BLOCK_N=2, BLOCK_K=4096), dict(num_warps=4, enable_fp_fusion=False))
       for name, epilogue in [("gemv", fused_triton.STORE), ("gemv_silu_gate", fused_triton.SILU_GATE),
                              ("gemv_rotate_q", fused_triton.ROTATE_Q)]},
    "rms_norm": (fused_triton._rms_norm_kernel,
                 dict(x_ptr=_P, delta_ptr=_P, w_ptr=_P, sum_ptr=_P, out_ptr=_P, n_cols=_I, eps="fp32"),
                 dict(HAS_DELTA=True, BLOCK=4096), dict(num_warps=16, enable_fp_fusion=False)),
    "silu_mul": (fused_triton._silu_mul_kernel, dict(gate_up_ptr=_P, out_ptr=_P, width=_I), dict(BLOCK=2048),
                 dict(num_warps=8, enable_fp_fusion=False)),
    "rotate": (fused_triton._rotate_kernel,
               dict(x_ptr=_P, cos_ptr=_P, sin_ptr=_P, out_ptr=_P, n_heads=_I, head_dim=_I, n_freq=_I),
               dict(BLOCK_H=32, BLOCK_F=64, BLOCK_R=0), dict(num_warps=8, enable_fp_fusion=False)),
}
# Per kernel, the loads before the wait: the GEMV's first weight tile (evict_first; the RoPE tables of
# gemv_rotate_q come after it), the norm weight.
_LOADS_BEFORE_WAIT = {"gemv": "weight", "gemv_silu_gate": "weight", "gemv_rotate_q": "weight", "rms_norm": 1,
                      "silu_mul": 0, "rotate": 0}


def _ptx(name: str, pdl: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    fn, types, constexprs, options = _KERNELS[name]
    signature = {arg: types.get(arg, "constexpr") for arg in fn.arg_names}
    # aligned pointers and sizes divisible by 16, as the launcher specializes a 7B model's: vector loads
    attrs = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]] for arg, t in types.items() if t != "fp32"}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs={**constexprs, "PDL": pdl},
                                       attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={**options, **({"launch_pdl": True} if pdl else {})}).asm["ptx"]


@pytest.mark.skipif(not fused_triton._triton_has_pdl(), reason="this Triton has no grid dependency control")
@pytest.mark.parametrize("name", sorted(_KERNELS))
def test_pdl_kernels_read_only_weights_before_the_wait(name):
    off = _ptx(name, pdl=False)
    assert "griddepcontrol" not in off
    ptx = _ptx(name, pdl=True)
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    before = ptx[:ptx.index("griddepcontrol.wait")]
    assert ptx.index("griddepcontrol.launch_dependents") > ptx.index("griddepcontrol.wait")
    assert not re.search(r"\bst\.global", before)
    loads = re.findall(r"\bld\.global[^\n]*", before)
    if _LOADS_BEFORE_WAIT[name] == "weight":  # all of the first K-block's weight, nothing else
        assert loads and all("evict_first" in load for load in loads)
        assert len(loads) == len(re.findall(r"\bld\.global[^\n]*evict_first", off))
    else:
        assert len(loads) == _LOADS_BEFORE_WAIT[name]


# --- on a GPU ---------------------------------------------------------------------------------------

def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0) and fused_triton._triton_has_pdl()


needs_pdl = pytest.mark.skipif(not _hopper(), reason="PDL needs compute capability 9.0 and a Triton with it")


@pytest.fixture
def pdl(monkeypatch):
    """pdl(on): kernels launched from then on with PDL (on) or without it."""
    def switch(on: bool) -> None:
        monkeypatch.setattr(fused_triton, "pdl_enabled", lambda device_index: on)
    return switch


def randn(*shape: int, dtype=torch.bfloat16, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


@pytest.mark.gpu
def test_conduit_pdl_0_turns_pdl_off(monkeypatch, fresh_switch):
    monkeypatch.delenv("CONDUIT_PDL", raising=False)
    x = randn(1, 64)
    assert fresh_switch(x.device.index) is _hopper()  # on by default where it can be: what the GPU runs measure
    fresh_switch.cache_clear()
    monkeypatch.setenv("CONDUIT_PDL", "0")
    assert fresh_switch(x.device.index) is False
    assert fused_triton._pdl_options(x) == {"PDL": False}


@pytest.mark.gpu
@needs_pdl
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_out,n_in", [(12288, 4096), (4096, 11008), (37, 100), (5, 8192), (22016, 4096)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_with_pdl_equals_gemv_without(pdl, dtype, n_out, n_in, with_bias):
    x, weight = randn(1, n_in, dtype=dtype), randn(n_out, n_in, dtype=dtype, scale=n_in**-0.5)
    bias = randn(n_out, dtype=dtype) if with_bias else None
    pdl(False)
    want = fused_triton.gemv(x, weight, bias)
    pdl(True)
    assert torch.equal(fused_triton.gemv(x, weight, bias), want)


@pytest.mark.gpu
@needs_pdl
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_kernels_with_pdl_equal_themselves_without(pdl, dtype):
    x, delta, weight = randn(3, 4096, dtype=dtype, scale=3.0), randn(3, 4096, dtype=dtype), randn(4096, dtype=dtype)
    gate_up = randn(2, 2 * 11008, dtype=dtype, scale=4.0)
    q = randn(5, 32, 128, dtype=dtype)
    cos, sin = randn(5, 64, dtype=dtype, seed=1), randn(5, 64, dtype=dtype, seed=2)
    partial = randn(5, 4, 80, dtype=dtype)  # rotary part of 32 of 80: the rest passes through

    def run():
        return (*fused_triton.rms_norm(x, delta, weight, 1e-5), fused_triton.rms_norm(x, None, weight, 1e-5)[1],
                fused_triton.silu_mul(gate_up), fused_triton.rotate(q, cos, sin),
                fused_triton.rotate(partial, cos[:, :16].contiguous(), sin[:, :16].contiguous()))

    pdl(False)
    want = run()
    pdl(True)
    for got, expected in zip(run(), want):
        assert torch.equal(got, expected)


def _layers(h: torch.Tensor, positions: torch.Tensor, w: dict[str, torch.Tensor], num_layers: int) -> torch.Tensor:
    """A decoder layer's chain of these kernels, num_layers times: norm, q projection, RoPE (tables
    from torch kernels in between), norm with the residual add, gate/up, SiLU product, down."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(64, device="cuda", dtype=torch.float32) / 64))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
    delta = torch.zeros_like(h)
    for _ in range(num_layers):
        h, normed = fused_triton.rms_norm(h, delta, w["norm1"], 1e-5)
        q = fused_triton.rotate(fused_triton.gemv(normed, w["q"]).view(1, 32, 128), cos, sin)
        h, normed = fused_triton.rms_norm(h, q.view(1, 4096), w["norm2"], 1e-5)
        delta = fused_triton.gemv(fused_triton.silu_mul(fused_triton.gemv(normed, w["gate_up"])), w["down"])
    return fused_triton.rms_norm(h, delta, w["norm1"], 1e-5)[1]


@pytest.mark.gpu
@needs_pdl
def test_pdl_chain_in_a_cuda_graph_equals_the_chain_without_pdl(pdl):
    """gemv -> rotate -> rms_norm -> gemv -> silu_mul -> gemv four times, captured with PDL and replayed
    with new inputs each time: each replay equals the chain run without PDL, to the bit. A kernel
    that read its input before its predecessor finished would read the previous replay's."""
    weights = {"q": randn(4096, 4096, scale=4096**-0.5), "gate_up": randn(2 * 11008, 4096, scale=4096**-0.5),
               "down": randn(4096, 11008, scale=11008**-0.5, seed=1),
               "norm1": randn(4096, seed=2) + 1, "norm2": randn(4096, seed=3) + 1}
    h = torch.empty(1, 4096, dtype=torch.bfloat16, device="cuda")
    positions = torch.empty(1, dtype=torch.int32, device="cuda")
    inputs = [(randn(1, 4096, scale=3.0, seed=10 + i), 17 + 1000 * i) for i in range(4)]

    pdl(False)
    wants = []
    for x, position in inputs:
        h.copy_(x)
        positions.fill_(position)
        wants.append(_layers(h, positions, weights, 4))
    pdl(True)
    h.copy_(inputs[0][0])
    positions.fill_(inputs[0][1])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles the PDL variants) outside the capture
        _layers(h, positions, weights, 4)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layers(h, positions, weights, 4)
    for (x, position), want in zip(inputs * 2, wants * 2):
        h.copy_(x)
        positions.fill_(position)
        graph.replay()
        assert torch.equal(out, want)
    for (x, position), want in zip(inputs, wants):  # and eagerly, with PDL
        h.copy_(x)
        positions.fill_(position)
        assert torch.equal(_layers(h, positions, weights, 4), want)
