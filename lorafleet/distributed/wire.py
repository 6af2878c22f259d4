"""An adapter version as it travels between Ray actors (trainer rank 0 -> sampler replicas)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

from lorafleet.model.banks import AdapterSpec

Payload = tuple[AdapterSpec, dict[str, tuple[torch.Tensor, torch.Tensor]]]
"""An adapter version: its spec (targets resolved) and per-layer A/B, fp32."""
WirePayload = tuple[AdapterSpec, dict[str, tuple[np.ndarray, np.ndarray]]]
"""The same in the object store: numpy arrays, which Ray reads without a copy on the node."""


def to_wire(
    spec: AdapterSpec, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> WirePayload:
    return spec, {
        path: (A.detach().cpu().numpy(), B.detach().cpu().numpy())
        for path, (A, B) in weights.items()
    }


def from_wire(payload: WirePayload) -> Payload:
    """Tensors over the (read-only) object-store arrays; the bank copies them right away."""
    spec, arrays = payload
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return spec, {
            path: (torch.from_numpy(A), torch.from_numpy(B)) for path, (A, B) in arrays.items()
        }
