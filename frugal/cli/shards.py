"""The safetensors files `frugal quantize` writes: tensors in as they are made, shards out.

A run that fails part way leaves nothing behind (remove), and the output folder never holds a mix
of this run's files and an earlier run's (those are deleted first: the loader reads every
`*.safetensors` in a folder).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def _usual_mode(path: Path) -> None:
    """The mode a new file gets from the umask (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


class Shards:
    """Output tensors written as they come: `model-NNNNN.safetensors` files of about
    MAX_BYTES each plus HF's `model.safetensors.index.json`, or one `model.safetensors`.
    The files of these names an earlier run left in the folder are deleted first (the loader
    reads every `*.safetensors` there); the folder must not be the input's."""

    MAX_BYTES = 2 * 2**30

    def __init__(self, out: Path, source: Path | None) -> None:
        if source is not None and out.resolve() == (source.resolve().parent if source.is_file()
                                                     else source.resolve()):
            raise ValueError(f"output: {out} holds the input checkpoint; choose another folder")
        self.created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
            old.unlink(missing_ok=True)
        self.out, self.pending, self.files, self.weight_map = out, {}, [], {}
        self.pending_bytes = self.bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        self.pending.update(tensors)
        self.pending_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        if self.pending_bytes >= self.MAX_BYTES:
            self._flush()

    def _write(self, name: str) -> None:
        path = self.out / name
        self.files.append(path)  # (before writing: a half-written file is removed too)
        save_file(self.pending, str(path), metadata={"format": "pt"})
        _usual_mode(path)
        self.weight_map.update(dict.fromkeys(self.pending, name))
        self.bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def _flush(self) -> None:
        self._write(f"model-{len(self.files) + 1:05d}.safetensors")

    def close(self) -> None:
        if not self.files:  # small enough for one file
            self._write("model.safetensors")
            return
        if self.pending:
            self._flush()
        index = {"metadata": {"total_size": self.bytes}, "weight_map": self.weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))

    def remove(self) -> None:
        """Delete what was written (the run failed part way), and the folder if it made it."""
        for path in self.files:
            path.unlink(missing_ok=True)
        if self.created and not any(self.out.iterdir()):
            self.out.rmdir()
