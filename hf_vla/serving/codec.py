"""msgpack-numpy, openpi's wire format (`openpi_client.msgpack_numpy`), with what a request may carry checked before a
byte of it is read as an array: plain bool/int/float arrays and numpy scalars whose shape fits their bytes."""

from __future__ import annotations

import dataclasses
import functools
import math

import msgpack
import numpy as np

from hf_vla.serving.policy import RequestError


def _pack_array(obj):
    if isinstance(obj, np.ndarray | np.generic) and obj.dtype.kind in "VOc":
        raise ValueError(f"unsupported dtype {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


# What a request's arrays may be: plain numbers. numpy builds an array of any dtype over the received bytes, and an
# object dtype (or a structured one with an object field) turns them into pointers that crash the process when read;
# strings, dates, void and complex numbers mean nothing to a policy. 16-byte floats (long double) torch cannot take.
WIRE_KINDS = "biuf"
MAX_WIRE_DIMS = 8


def _wire_dtype(spec) -> np.dtype:
    """The dtype of a received array or scalar, refused unless it is a plain bool/int/float (any byte order)."""
    if isinstance(spec, bytes):
        spec = spec.decode("ascii", "replace")
    if not isinstance(spec, str):  # a dict/list spec builds a structured dtype
        raise RequestError(f"array dtype must be a numpy type string such as '<f4', got a {type(spec).__name__}")
    try:
        dtype = np.dtype(spec)
    except (TypeError, ValueError, SyntaxError) as error:
        raise RequestError(f"array dtype {spec[:40]!r} is not a numpy dtype") from error
    if (dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None or dtype.kind not in WIRE_KINDS
            or dtype.itemsize > 8):
        raise RequestError(f"array dtype {spec[:40]!r} ({dtype.kind!r} kind): only bool, integer and float arrays "
                           f"(up to 64 bits) are accepted")
    return dtype


@dataclasses.dataclass(frozen=True)
class RefusedArray:
    """What the decoder puts in place of an array or numpy scalar it will not build (`reason` says why); the server
    answers a request holding one as a bad request naming its key."""

    reason: str


def _unpack_array(obj):
    """openpi_client.msgpack_numpy's decoding, with the client's dtype and shape checked before a byte is read as an
    array: anything but a plain numeric array whose shape fits its bytes becomes a `RefusedArray`."""
    try:
        return _decode_array(obj)
    except RequestError as error:
        return RefusedArray(str(error))


def refused_arrays(value, key: str = "", depth: int = 0):
    """(key path, reason) of every `RefusedArray` in a decoded message (dicts and lists, a few levels deep)."""
    if isinstance(value, RefusedArray):
        yield key or "message", value.reason
    elif depth < 4 and isinstance(value, dict):
        for name, item in value.items():
            yield from refused_arrays(item, f"{key}.{name}" if key else str(name), depth + 1)
    elif depth < 4 and isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from refused_arrays(item, f"{key}[{index}]", depth + 1)


def _decode_array(obj):
    if b"__ndarray__" in obj:
        dtype = _wire_dtype(obj.get(b"dtype"))
        data, shape = obj.get(b"data"), obj.get(b"shape")
        if not isinstance(data, bytes):
            raise RequestError(f"array data must be bytes, got {type(data).__name__}")
        if (not isinstance(shape, list | tuple) or len(shape) > MAX_WIRE_DIMS
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)):
            raise RequestError(f"array shape must be a list of at most {MAX_WIRE_DIMS} non-negative integers, got "
                               f"{str(shape)[:80]}")
        if math.prod(shape) * dtype.itemsize != len(data):
            raise RequestError(f"array of shape {tuple(shape)[:MAX_WIRE_DIMS]} and dtype {dtype.str} needs "
                               f"{math.prod(shape) * dtype.itemsize} bytes, the message has {len(data)}")
        array = np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))
        return array if dtype.isnative else array.astype(dtype.newbyteorder("="))
    if b"__npgeneric__" in obj:
        dtype = _wire_dtype(obj.get(b"dtype"))
        value = obj.get(b"data")
        # a numpy bool (openpi's client sends `np.bool_(True)` as one) carries a Python bool; numbers carry numbers
        if (isinstance(value, bool) and dtype.kind != "b") or not isinstance(value, int | float):
            raise RequestError(f"numpy scalar data must be a number, got {type(value).__name__}")
        try:
            return dtype.type(value)
        except (OverflowError, ValueError) as error:
            raise RequestError(f"numpy scalar {value!r} does not fit {dtype.str}") from error
    return obj


packb = functools.partial(msgpack.packb, default=_pack_array)
unpackb = functools.partial(msgpack.unpackb, object_hook=_unpack_array)


__all__ = ["MAX_WIRE_DIMS", "RefusedArray", "WIRE_KINDS", "packb", "refused_arrays", "unpackb"]
