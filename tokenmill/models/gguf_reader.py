"""Open a GGUF file's metadata fast, without torch (the tokenizer of an API-server process needs it)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np


class GGUFError(ValueError):
    pass


def open_gguf(path: str | Path):
    """Open (memory-map) a GGUF file; parsing its metadata is slow, so readers are reused per file version."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise GGUFError(f"cannot open {path}: {e.strerror}") from None
    return _open_gguf(str(p.resolve()), st.st_mtime_ns, st.st_size)


@functools.cache
def _reader_class():
    import gguf

    class Reader(gguf.GGUFReader):
        """The gguf package's reader over a plain ndarray view of its memory map: its metadata parse
        slices the map ~10^6 times, and numpy.memmap's per-slice bookkeeping was 60% of the load time
        (SmolLM2's 49k-token vocabulary: 6.5 -> 2.5 s). The view keeps the map alive and read-only."""

        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value):
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            """Arrays (the vocabulary, its merges, scores and types) as a few parts instead of one or two
            numpy views per element: 245k views were 75 MB and most of the parse. ReaderField.contents()
            reads them the same way (it flattens the parts its data indexes, and calls tobytes() on a
            string's); only contents(i) on a numeric array would differ, and nothing here calls it."""
            gtype = gguf.GGUFValueType(raw_type)
            if gtype != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            n, sub = int(alen[0]), gguf.GGUFValueType(int(itype[0]))
            offs = orig_offs + 12
            if sub == gguf.GGUFValueType.STRING:
                mv = memoryview(self._data)
                parts = [itype, alen]
                for _ in range(n):
                    ln = int.from_bytes(mv[offs:offs + 8], "little")
                    parts.append(_Bytes(mv[offs + 8:offs + 8 + ln]))
                    offs += 8 + ln
                return offs - orig_offs, parts, list(range(2, n + 2)), [gtype, sub]
            nptype = self.gguf_scalar_to_np.get(sub)
            if nptype is None:  # nested arrays: the package's own parse
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, n)
            return 12 + int(values.nbytes), [itype, alen, values], [2], [gtype, sub]

    return Reader


class _Bytes(bytes):
    """A string element of a GGUF array: bytes with numpy's tobytes(), which ReaderField.contents() calls."""

    __slots__ = ()

    def tobytes(self) -> bytes:
        return bytes(self)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, mtime_ns: int, size: int):
    try:
        return _reader_class()(path)
    except Exception as e:  # the reader raises assorted errors on damaged files
        raise GGUFError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
