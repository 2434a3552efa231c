"""Model FLOPs utilisation: achieved training FLOP/s over the accelerator's dense bf16 peak."""

from __future__ import annotations

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets.
_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; PCIe is 756e12, matched below
    "H100 PCIE": 756e12,
    "A100": 312e12,
    "L40S": 362e12,
}


def peak_flops(device_name: str | None) -> float | None:
    """Peak bf16 FLOP/s for a CUDA device name, or None when unknown (e.g. CPU)."""
    if not device_name:
        return None
    name = device_name.upper()
    for key in sorted(_PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in name:
            return _PEAK_BF16_FLOPS[key]
    return None


def mfu(
    tokens_per_s: float, flops_per_token: float, num_devices: int, peak: float | None
) -> float | None:
    """Fraction of peak achieved; None when the peak is unknown."""
    if peak is None or num_devices < 1:
        return None
    return tokens_per_s * flops_per_token / (peak * num_devices)
