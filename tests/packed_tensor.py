"""A small tensor subclass written for the tests: int8 codes with one float32 scale per
row, implementing FSDP2's all-gather extension protocol and nothing more than sharding
needs. It counts its protocol calls, so a test can tell that a gather went through it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten
CALLS = {"pre": 0, "post": 0, "post_out": 0}


class RowInt8Codes(torch.Tensor):
    """A float32 matrix stored as ``codes`` (int8, its shape) times ``scales`` (a float32
    per row), without the extension protocol. ``scales`` may hold any bit pattern, NaN
    payloads included: the tests use them to see that bytes travel unchanged."""

    codes: torch.Tensor
    scales: torch.Tensor

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scales: torch.Tensor) -> RowInt8Codes:
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=torch.float32,
                                                   device=codes.device, requires_grad=False)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        self.codes, self.scales = codes, scales

    @classmethod
    def quantize(cls, w: torch.Tensor) -> RowInt8Codes:
        scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127
        return cls(torch.round(w / scales[:, None]).to(torch.int8), scales)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales[:, None]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({tuple(self.shape)})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["codes", "scales"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, ctx: Any, size: Any, stride: Any
                             ) -> RowInt8Codes:
        return cls(inner["codes"], inner["scales"])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return F.linear(x, w.dequantize(), bias)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.detach.default:
            t = args[0]
            return type(t)(t.codes.detach(), t.scales.detach())
        if func is aten.view.default and tuple(args[1]) == tuple(args[0].shape):
            t = args[0]  # DTensor.from_local views its local tensor as itself
            return type(t)(t.codes.view(t.codes.shape), t.scales.view(t.scales.shape))
        if func is aten.split.Tensor:
            t, size = args[0], args[1]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
            assert dim == 0, "RowInt8 splits rows only"
            return [type(t)(c, s) for c, s in zip(t.codes.split(size), t.scales.split(size))]
        raise NotImplementedError(f"{cls.__name__} does not implement {func}")


class OnlyPre(RowInt8Codes):
    """Half the protocol: refused, as FSDP2 refuses it."""

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS["pre"] += 1
        return (self.codes, self.scales), None


class RowInt8(OnlyPre):
    """With FSDP2's whole extension protocol (torch/distributed/fsdp/_fully_shard/
    _fsdp_param.py)."""

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        codes, scales = outputs
        if out is not None:
            CALLS["post_out"] += 1
            assert out.codes.untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
            return None
        CALLS["post"] += 1
        return RowInt8(codes, scales), (codes, scales)


class CountedRows(RowInt8):
    """RowInt8 whose chunks also carry their own row count as an inner tensor: neither
    the full tensor's count nor a part of it, so a checkpoint cannot reshard it (and
    says so), while training works."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scales: torch.Tensor,
                rows: torch.Tensor | None = None) -> CountedRows:
        return RowInt8Codes.__new__(cls, codes, scales)

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor,
                 rows: torch.Tensor | None = None) -> None:
        super().__init__(codes, scales)
        self.rows = torch.tensor([codes.shape[0]]) if rows is None else rows

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["codes", "scales", "rows"], None

    @classmethod
    def __tensor_unflatten__(cls, inner: dict, ctx: Any, size: Any, stride: Any
                             ) -> CountedRows:
        return cls(inner["codes"], inner["scales"], inner["rows"])

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if out is not None:
            return None
        codes, scales = outputs
        return CountedRows(codes, scales), (codes, scales)
