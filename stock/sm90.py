"""Where a third-party Hopper kernel built for sm_90a can run: a one-line ImportError otherwise (the
candidate or peer cannot run here, which the harness and the bench report as a skip with its reason)."""
from __future__ import annotations

import torch


def require_sm90a(t: torch.Tensor, who: str) -> None:
    """`who` (e.g. "stock.flashmla: FlashMLA's dense decode") runs on t's device, CUDA sm_90."""
    if t.device.type != "cuda":
        raise ImportError(f"{who} runs on CUDA sm_90a only, not on {t.device.type}")
    capability = torch.cuda.get_device_capability(t.device)
    if capability != (9, 0):
        raise ImportError(f"{who} is built for sm_90a; this device is sm_{capability[0]}{capability[1]}")
