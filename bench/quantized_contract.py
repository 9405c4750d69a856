"""The contract of quantized (8-bit) state formats across backends (docs/numerics.md, "The GPU kernels"): a kernel
need not store the reference's bits, but each code within one code step of the reference's, the same
blocks flagged and the same special codes (inf and NaN stay in their element), and the params of a step
within a bound derived from the arithmetic it may approximate. Kernels are deterministic."""

from __future__ import annotations

import torch

from lowbit_compile.formats import StateFormat, special_codes
from lowbit_compile.formats.blockquant import Quantized, unpacked_codes

# A step from the same inputs: approximate square root (<= 2 ulps), division (div.full: <= 2 ulps) and
# contracted multiply-adds (one rounding fewer each) move the update by at most UPDATE_ULPS of itself,
# and the decayed param by one rounding more than the reference's.
UPDATE_ULPS = 8
PARAM_ULPS = 2


def code_rank(codes: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Each code's position in value order (adjacent codes differ by one): fp8 codes are sign and
    magnitude, int8/sqrt8 signed codes two's complement, the rest (unsigned, dynamic8) their byte."""
    u = codes.view(torch.uint8).to(torch.int32)
    if fmt.name.startswith("fp8"):
        magnitude = u & 0x7F
        return torch.where(u >= 0x80, -magnitude, magnitude)
    if codes.dtype == torch.int8:
        return codes.to(torch.int32)
    return u


def assert_codes_within_one_step(ref: Quantized, ours: Quantized, fmt: StateFormat, scale_ulps: int = 0,
                                 what: object = "") -> None:
    """``ours`` keeps the contract against ``ref``: the same flagged blocks, the same special code in
    each non-finite element of one, every other code within one step, scales within ``scale_ulps`` ulps
    (0: the same bits), the same patch offsets and patch values within one bf16 step. A 4-bit format's codes
    are compared unpacked (an odd count's unused last nibble with them)."""
    if fmt.packed:
        ref, ours = (q._replace(codes=unpacked_codes(q.codes, 2 * q.codes.numel(), fmt)) for q in (ref, ours))
    n = ref.codes.numel()
    flagged = ref.scales.view(torch.int32) < 0
    assert torch.equal(flagged, ours.scales.view(torch.int32) < 0), ("flagged blocks", what)
    scale_gap = (ref.scales.view(torch.int32) - ours.scales.view(torch.int32)).abs()
    assert _largest(scale_gap) <= scale_ulps, ("scales", what, _largest(scale_gap))
    in_flagged = flagged.repeat_interleave(fmt.block_size)[:n]
    specials = torch.tensor(special_codes(fmt), dtype=torch.uint8)
    ref_special = in_flagged & torch.isin(ref.codes.view(torch.uint8), specials)
    our_special = in_flagged & torch.isin(ours.codes.view(torch.uint8), specials)
    assert torch.equal(ref_special, our_special), ("non-finite elements", what)
    assert torch.equal(ref.codes.view(torch.uint8)[ref_special], ours.codes.view(torch.uint8)[ref_special]), what
    steps = (code_rank(ref.codes, fmt) - code_rank(ours.codes, fmt)).abs()[~ref_special]
    assert _largest(steps) <= 1, ("codes", what, _largest(steps))
    assert torch.equal(ref.patch_index, ours.patch_index), ("patch offsets", what)
    patch_gap = (ref.patch_values.view(torch.int16).int() - ours.patch_values.view(torch.int16).int()).abs()
    assert _largest(patch_gap) <= 1, ("patch values", what)


def _largest(t: torch.Tensor) -> int:
    return int(t.max()) if t.numel() else 0


def assert_params_within_bound(ours: torch.Tensor, ref: torch.Tensor, before: torch.Tensor, what: object = "") -> None:
    """A step's new params against the reference's from the same inputs: NaN and inf where it has them,
    elsewhere within ``PARAM_ULPS`` ulps of the param plus ``UPDATE_ULPS`` ulps of the update (fp32 ulps;
    a bf16/fp16 param rounds that once more: one ulp of its own type more)."""
    rounding = torch.finfo(ref.dtype).eps if ref.dtype != torch.float32 else 0.0
    ours, ref, before = ours.detach().float(), ref.detach().float(), before.detach().float()
    assert torch.equal(ours.isnan(), ref.isnan()), ("NaN params", what)
    finite = torch.isfinite(ref)
    assert torch.equal(ours[~finite & ~ref.isnan()], ref[~finite & ~ref.isnan()]), ("infinite params", what)
    eps = torch.finfo(torch.float32).eps
    update = torch.where(torch.isfinite(before), ref - before, 0.0)
    bound = (PARAM_ULPS * eps + rounding) * ref.abs() + UPDATE_ULPS * eps * update.abs()
    gap = (ours - ref).abs()[finite]
    assert torch.all(gap <= bound[finite]), (what, float((gap - bound[finite]).max()))
