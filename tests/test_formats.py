"""Each storage format against a float64 reference: patches, per-element error bounds, the
zero-point rule, odd sizes, and the QuantizedState tensor protocol."""

from __future__ import annotations

import pytest
import torch

from lowbit_compile import QuantizedState
from lowbit_compile.formats import StateFormat, blockquant, decode, element_format, encode, normalize
from lowbit_compile.formats.dynamic import dynamic_level_table, dynamic_levels, dynamic_map, dynamic_thresholds
from lowbit_compile.state import codec

from .helpers import BLOCKWISE, FP8, KERNEL_FORMATS, dynamic8_probes

ALL = KERNEL_FORMATS
# Half a code step of each element format, relative to the largest code (qmax) or to the value.
FP8_REL = {"fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}
FP8_SUBNORMAL_STEP = {"fp8_e4m3": 2.0**-9, "fp8_e5m2": 2.0**-16}


def _values(n: int, nonneg: bool, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed values (log-normal magnitudes over ~6 decades) with a few giants and zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64) * torch.exp(2 * torch.randn(n, generator=gen, dtype=torch.float64))
    x[:: max(n // 7, 1)] *= 1e3
    x[3::50] = 0.0
    return (x.abs() if nonneg else x).float()


def _reference_patches(x64: torch.Tensor, fmt: StateFormat):
    """Per block, offsets of the K largest |x| (ties: lowest offset), in float64."""
    b, n = fmt.block_size, x64.numel()
    nb = -(-n // b)
    padded = torch.zeros(nb * b, dtype=torch.float64)
    padded[:n] = x64
    blocks = padded.view(nb, b)
    mag = blocks.abs()
    # sort by (-|x|, offset): stable sort on -|x| keeps lower offsets first among equals
    order = torch.sort(-mag, dim=1, stable=True).indices[:, : fmt.outliers]
    return blocks, order


@pytest.mark.parametrize("nonneg", [False, True], ids=["signed", "nonneg"])
@pytest.mark.parametrize("name", BLOCKWISE)
@pytest.mark.parametrize(("n", "block", "k"), [(5000, 2048, 2), (1000, 256, 4), (300, 256, 0), (1, 256, 2), (3, 256, 4)])
def test_blockwise_format_against_float64(name, nonneg, n, block, k):
    fmt = StateFormat(name, block, k, nonneg)
    x = _values(n, nonneg)
    q = blockquant.quantize(x, fmt)
    dq = blockquant.dequantize(q, fmt, numel=n).double()
    x64 = x.double()
    blocks, order = _reference_patches(x64, fmt)

    # patches: the K largest magnitudes, kept as bf16
    assert torch.equal(q.patch_index.long(), order)
    assert torch.equal(q.patch_values, blocks.gather(1, order).to(torch.bfloat16))

    # everything else: within half a code step of the block's non-patch absmax
    rest = blocks.clone()
    rest.scatter_(1, order, 0.0)
    absmax = rest.abs().amax(1)
    exact = absmax / fmt.qmax
    if fmt.neg_qmax != fmt.qmax:  # signed dynamic8: each side over its end of the map
        exact = torch.maximum(rest.amax(1).clamp(min=0) / fmt.qmax, (-rest).amax(1).clamp(min=0) / fmt.neg_qmax)
    assert torch.allclose(q.scales.double(), exact, rtol=1e-6, atol=0)
    nb = absmax.numel()
    is_patch = torch.zeros(nb * block, dtype=torch.bool)
    is_patch.view(nb, block).scatter_(1, order, True)
    is_patch = is_patch[:n]
    scale = exact.repeat_interleave(block)[:n]
    err = (dq - x64).abs()
    if name == "int8":
        bound = scale / 2
    elif name == "dynamic8":
        table = dynamic_map(nonneg).double()
        gaps = (table[1:] - table[:-1]).max()  # the widest gap of the map bounds the rounding
        bound = (gaps / 2) * scale * fmt.qmax
    elif element_format(name).root_domain:  # the square root within 1/2: |c^2 - t| <= sqrt(t) + 1/4 (t = |x| / scale)
        bound = (torch.where(scale > 0, x64.abs() / scale, 0.0).sqrt() + 0.25) * scale
    else:
        bound = torch.maximum(FP8_REL[name] * x64.abs(), FP8_SUBNORMAL_STEP[name] / 2 * scale)
    if nonneg:  # a tiny positive value is raised to the smallest code instead of 0
        bound = torch.maximum(bound, fmt.min_positive * scale)
    slack = 1e-6 * scale + 1e-30  # fp32 arithmetic of x * (qmax / absmax)
    keep = ~is_patch
    assert torch.all(err[keep] <= bound[keep] + slack[keep]), (err - bound)[keep].max()

    if nonneg:  # the zero-point problem: nothing positive decodes to zero
        assert not torch.any((x64 > 0) & (dq == 0))
        assert torch.all(dq >= 0)


def test_dynamic8_encodes_to_the_nearest_map_value():
    """Beyond the bound: every code is the nearest entry of the map (float64 search)."""
    for nonneg in (False, True):
        fmt = StateFormat("dynamic8", 256, 0, nonneg)
        x = _values(4096, nonneg)
        q = blockquant.quantize(x, fmt)
        table = dynamic_map(nonneg).double()
        norm = (x.double().view(16, 256) / q.scales.double()[:, None]).reshape(-1)
        nearest = (norm[:, None] - table[None, :]).abs()
        best = nearest.min(1).values
        chosen = nearest.gather(1, q.codes.long()[:, None])[:, 0]
        tie_or_fp32 = 1e-6 * norm.abs() + 1e-12
        raised = nonneg & (x > 0) & (q.codes == 1)  # zero-point rule may pick the smallest positive
        assert torch.all((chosen <= best + tie_or_fp32) | raised)


def _nearest_codes(x: torch.Tensor, nonneg: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force over the 256 decoded values (float64): the distance to the nearest, and whether
    two different values are that near (an exact tie)."""
    table = dynamic_map(nonneg).double().unique()
    best, tied = [], []
    for chunk in x.double().split(1 << 16):
        d = (chunk[:, None] - table[None, :]).abs()
        lo = d.min(1).values
        best.append(lo)
        tied.append((d == lo[:, None]).sum(1) > 1)
    return torch.cat(best), torch.cat(tied)


@pytest.mark.slow
@pytest.mark.parametrize("nonneg", [False, True])
def test_dynamic8_encode_is_exactly_the_nearest_of_the_256_values(nonneg):
    """Exact in float64: each finite |x| <= 1 gets a code at the smallest distance (an exact tie
    to the larger magnitude); a non-negative state's positive values never become 0."""
    fmt = StateFormat("dynamic8", nonneg=nonneg)
    x = dynamic8_probes(nonneg)
    x = x[torch.isfinite(x) & (x.abs() <= 1)]
    codes = encode(x, fmt)
    got = decode(codes, fmt).double()
    best, tied = _nearest_codes(x, nonneg)
    raised = torch.zeros_like(x, dtype=torch.bool)
    if nonneg:
        assert torch.all(codes[x < 0] == 0) and not torch.any((x > 0) & (codes == 0))
        raised = (x > 0) & (x < dynamic_thresholds(True)[0])  # the smallest positive instead of 0
        x, got, best, tied, raised = (t[x >= 0] for t in (x, got, best, tied, raised))
    dist = (x.double() - got).abs()
    assert torch.all((dist == best) | raised)
    assert torch.all(got[tied].abs() >= x[tied].double().abs())  # ties: the larger magnitude
    assert int(encode(torch.tensor([float("nan")]), fmt)) == 255  # NaN saturates at the top code


@pytest.mark.slow
@pytest.mark.parametrize("nonneg", [False, True], ids=["signed", "nonneg"])
def test_sqrt8_codes_are_the_rounded_square_roots(nonneg):
    """Over the whole float range (zeros, subnormals, every tie (c + 1/2)^2 and its fp32 neighbours,
    past qmax, inf) and block multipliers from 2^-100 to 2^126: the code's magnitude is the root domain
    value (the fp32 root of |x| times the fp32 root of the multiplier, ``normalize``) clamped to
    sqrt(qmax) and rounded half to even, so within 1/2 of the exact sqrt(|x| * multiplier) plus 1.5
    ulp of it; its sign x's, its value c * |c|; a non-negative state's positive values never become 0
    (the product of two roots never underflows)."""
    fmt = StateFormat("sqrt8", nonneg=nonneg)
    top = 255 if nonneg else 127
    ties = (torch.arange(top + 1, dtype=torch.float64) + 0.5).square().float()
    near = torch.cat([(ties.view(torch.int32) + d).view(torch.float32) for d in (-2, -1, 0, 1, 2)])
    squares = torch.arange(top + 1, dtype=torch.float32).square()
    spread = 2.0 ** torch.linspace(-149, 127.99, 20001)
    x = torch.cat([near, squares, spread, torch.rand(20000) * fmt.qmax * 1.2,
                   torch.tensor([0.0, 2.0**-149, fmt.qmax, fmt.qmax * 2.5, float("inf")])])
    x = x if nonneg else torch.cat([x, -x, torch.tensor([-0.0])])
    for inverse in (1.0, 0.7390851, 3.0517578e-05 * 1.3, 2.0**126, 2.0**-100):
        codes = encode(normalize(x, torch.tensor(inverse), fmt), fmt)
        c = codes.double()
        assert torch.equal(decode(codes, fmt).double(), c * c.abs())
        product = x.abs().double().sqrt().float().double() * torch.tensor(inverse).double().sqrt().float().double()
        r = product.float().double().clamp(max=top)  # the fp32 root domain value
        miss = (r - c.abs()).abs()
        lifted = (x > 0) & (r <= 0.5) if nonneg else torch.zeros_like(x, dtype=torch.bool)  # to code 1
        assert torch.all((miss < 0.5) | ((miss == 0.5) & (c % 2 == 0)) | lifted)
        exact = (x.double().abs() * inverse).sqrt().clamp(max=top)
        assert torch.all(((exact - c.abs()).abs() <= 0.5 + exact * 1.5 * 2.0**-23) | lifted)
        assert torch.all(c.abs() <= top) and torch.all((c >= 0) | (x < 0))
        if nonneg:
            assert not torch.any((x > 0) & (codes == 0))
        else:
            assert torch.all((c <= 0) | (x > 0))


def test_dynamic8_map_is_symmetric_and_arithmetic():
    """The signed map holds -1..1 symmetrically (so qmax is 1 for both signs), code 127 is zero;
    spacing * p + offset in fp32 gives every value, and every threshold is the exact midpoint."""
    signed = dynamic_map(False)
    assert torch.equal(signed[:255], -signed[:255].flip(0)) and signed[127] == 0 and signed[254] == 1
    assert StateFormat("dynamic8").qmax == 1.0 == StateFormat("dynamic8", nonneg=True).qmax
    for nonneg in (False, True):
        table = dynamic_map(nonneg)
        mags = table[128:255] if not nonneg else table[1:]
        p = torch.arange(1, len(mags) + 1, dtype=torch.float32)
        level = torch.log2(p).floor().long()
        rows = dynamic_level_table(nonneg)
        spacing, offset = rows[3][level], rows[4][level]
        assert torch.equal(p * spacing + offset, mags)
        assert torch.equal(torch.addcmul(offset, p, spacing), mags)  # an fma rounds the same
        mids = (torch.cat([torch.zeros(1), mags[:-1]]).double() + mags.double()) / 2
        assert torch.equal(dynamic_thresholds(nonneg).double(), mids)
        tops = [lv.spacing * (2 * lv.first - 1) + lv.offset for lv in dynamic_levels(nonneg)]
        assert tops[-1] == 1.0 and all(b > 8 * a for a, b in zip(tops, tops[1:]))  # about a decade each


@pytest.mark.parametrize("nonneg", [False, True])
def test_bf16_format_is_round_to_nearest(nonneg):
    fmt = StateFormat.make("bf16", 256, 2, nonneg)
    x = _values(3000, nonneg)
    dq = blockquant.dequantize(blockquant.quantize(x, fmt), fmt)
    assert torch.equal(dq, x.to(torch.bfloat16).float())
    assert fmt.patches == 0 and blockquant.quantize(x, fmt).scales.numel() == 0


@pytest.mark.parametrize("name", FP8)
def test_fp8_encode_is_the_nearest_code_ties_to_even_by_the_formats_own_arithmetic(name):
    """fp8 codes are the nearest of the format's finite values (decoded by the library), ties to the
    even code, -0 kept: every midpoint and its fp32 neighbours, every value, random magnitudes over
    the whole range. Defined by the library's arithmetic, not a torch version's float8 cast (which
    torch 2.11 and 2.13 agree with on CPU)."""
    fmt = StateFormat.make(name, 256, 0, False)
    values = decode(torch.arange(256, dtype=torch.uint8).view(fmt.code_dtype), fmt).double()
    finite = torch.isfinite(values) & ((torch.arange(256) < 128) | (values != 0))  # +0 once
    table, codes = values[finite].sort()
    codes = torch.arange(256)[finite][codes]
    mids = ((table[1:] + table[:-1]) / 2).float()
    gen = torch.Generator().manual_seed(0)
    rand = (torch.randn(20000, generator=gen) * torch.exp2(torch.randint(-28, 18, (20000,), generator=gen).float()))
    x = torch.cat([mids, mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(-float("inf"))),
                   table.float(), rand.clamp(-fmt.qmax, fmt.qmax), torch.tensor([0.0, -0.0])])
    dist = (x.double()[:, None] - table[None, :]).abs()
    nearest = dist == dist.min(dim=1, keepdim=True).values
    even = nearest & (codes[None, :] % 2 == 0)
    pick = torch.where(nearest.sum(dim=1, keepdim=True) > 1, even, nearest).float().argmax(dim=1)
    want = codes[pick]
    want = torch.where((table[pick] == 0) & x.signbit(), 0x80, want)  # rounding to zero keeps the sign: -0
    got = encode(x, fmt).view(torch.uint8).long()
    assert torch.equal(got, want)


def test_ties_in_magnitude_go_to_the_lowest_offset():
    fmt = StateFormat("int8", 8, 2, False)
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -3.0, 0.5, 0.0, 1.0])
    q = blockquant.quantize(x, fmt)
    assert q.patch_index.tolist() == [[1, 3]]


def test_all_zero_block_has_zero_scale_and_decodes_to_zero():
    for name in BLOCKWISE:
        fmt = StateFormat(name, 256, 2, False)
        q = blockquant.quantize(torch.zeros(600), fmt)
        assert torch.all(q.scales == 0)
        assert torch.all(blockquant.dequantize(q, fmt, numel=600) == 0)


def test_full_builds_the_same_storage_as_quantizing_a_constant():
    for name in ALL:
        fmt = StateFormat.make(name, 256, 2, False)
        for value in (0.0, 0.25):
            a = blockquant.full(1000, value, fmt)
            b = blockquant.quantize(torch.full((1000,), value), fmt)
            for x, y in zip(a, b):
                assert torch.equal(x, y), name


class TestQuantizedState:
    fmt = StateFormat("int8", 256, 2, False)

    def _state(self, shape=(30, 20)):
        return QuantizedState.from_dense(torch.randn(shape), self.fmt)

    def test_shape_dtype_and_dequantize(self):
        x = torch.randn(30, 20)
        s = QuantizedState.from_dense(x, self.fmt)
        assert s.shape == x.shape and s.dtype == x.dtype and isinstance(s, torch.Tensor)
        assert s.dequantize().shape == x.shape
        assert (s.dequantize() - x).abs().max() <= x.abs().max() / 127

    def test_from_dense_in_chunks_equals_one_pass(self):
        x = torch.randn(5000)
        a = QuantizedState.from_dense(x, self.fmt, chunk_blocks=3)
        b = blockquant.quantize(x, self.fmt)
        for u, v in zip(a.storage_parts, b):
            assert torch.equal(u, v)

    def test_ops_see_dequantized_values(self):
        s = self._state()
        assert torch.allclose(s.norm(), s.dequantize().norm())
        assert torch.equal(s + 1, s.dequantize() + 1)

    def test_inplace_op_requantizes(self):
        s = self._state()
        expected = s.dequantize() * 2
        s.mul_(2)
        assert isinstance(s, QuantizedState)
        assert (s.dequantize() - expected).abs().max() <= expected.abs().max() / 127

    def test_clone_detach_to_copy(self):
        s = self._state()
        c = s.clone()
        assert isinstance(c, QuantizedState) and c.codes.data_ptr() != s.codes.data_ptr()
        assert torch.equal(c.dequantize(), s.dequantize())
        assert torch.equal(s.detach().dequantize(), s.dequantize())
        assert torch.equal(s.to(torch.float64), s.dequantize().double())

    def test_copy_from_dense_and_quantized(self):
        s = self._state()
        x = torch.randn(30, 20)
        s.copy_(x)
        assert torch.equal(s.dequantize(), QuantizedState.from_dense(x, self.fmt).dequantize())
        t = self._state()
        s.copy_(t)
        assert torch.equal(s.codes, t.codes)

    def test_packed_round_trip(self):
        s = self._state()
        param = torch.empty(s.shape)
        back = codec.unpack(codec.pack(s, param), param)
        assert back.fmt == s.fmt and back.shape == s.shape
        assert all(torch.equal(a, b) for a, b in zip(back.storage_parts, s.storage_parts))
