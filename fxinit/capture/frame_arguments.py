"""A frame's arguments, read without touching the dict ``locals()`` returned in that frame.

On CPython 3.10 to 3.12, reading ``frame.f_locals`` copies the frame's variables into one dict
per frame, the very dict ``locals()`` returned there: a constructor that keeps
``self._locals = locals()`` and deletes ``self`` from it (imagen-pytorch, dalle2-pytorch) would
get its deleted keys back, and the later values of its variables, each time the capture asked
which module a recorded op belongs to. So the capture reads an argument from the frame's own
slots (where CPython keeps a function's arguments, first in order), found once by a probe at
import: a frame whose arguments are known objects. Where the probe does not find them (another
interpreter, another layout), and on 3.13 and later, where ``f_locals`` is a view that copies
nothing (PEP 667), ``f_locals`` is read.

>>> import sys
>>> def f(a, b):
...     return argument(sys._getframe(), 1)
>>> f("x", "y")
'y'
"""

from __future__ import annotations

import ctypes
import sys
import types
from typing import Any


def argument(frame: types.FrameType, index: int) -> Any:
    """The current value of ``frame``'s argument number ``index`` (``None`` if it is unbound:
    deleted, or ``index`` is not an argument)."""
    code = frame.f_code
    if index >= code.co_argcount + code.co_kwonlyargcount:
        return None
    if _SLOTS is None:
        return frame.f_locals.get(code.co_varnames[index])
    base = _POINTER(id(frame) + _F_FRAME).value if _INDIRECT else id(frame)
    try:
        value = _OBJECT(base + _SLOTS + 8 * index).value
    except ValueError:  # (an empty slot: deleted, or 3.10's captured argument, kept in its cell only)
        if _INDIRECT or code.co_varnames[index] not in code.co_cellvars:
            return None
        value = _OBJECT(base + _SLOTS + 8 * (code.co_nlocals + code.co_cellvars.index(code.co_varnames[index]))).value
    if type(value) is _CELL and code.co_varnames[index] in code.co_cellvars:  # captured by a closure
        return value.cell_contents if _cell_is_full(value) else None
    return value


_CELL = types.CellType
_POINTER = ctypes.c_void_p.from_address
_OBJECT = ctypes.py_object.from_address  # (the object a pointer at an address points to; ValueError if NULL)


def _cell_is_full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


_F_FRAME = 3 * 8  # PyFrameObject: ob_refcnt, ob_type, f_back, then f_frame (3.11, 3.12)
_INDIRECT = sys.version_info >= (3, 11)


def _probe() -> int | None:
    """The offset of the first argument in a frame's slots, found by looking for known
    arguments there (in a live frame and in a finished one); None where they are not found."""
    if sys.implementation.name != "cpython" or sys.version_info >= (3, 13) or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    first, second = object(), object()

    def live(a: object, b: object) -> tuple[types.FrameType, int | None]:
        f = sys._getframe()
        return f, _find(f, id(a), id(b))

    def _find(f: types.FrameType, a: int, b: int) -> int | None:
        base = id(f)
        if _INDIRECT:
            base = ctypes.c_void_p.from_address(base + _F_FRAME).value or 0
            if not base:
                return None
        for offset in range(0, 512, 8):
            if (ctypes.c_void_p.from_address(base + offset).value == a
                    and ctypes.c_void_p.from_address(base + offset + 8).value == b):
                return offset
        return None

    frame, offset = live(first, second)
    if offset is None or _find(frame, id(first), id(second)) != offset:  # (a finished frame: the same layout)
        return None
    return offset


_SLOTS: int | None = _probe()
