"""The numerics classes: which kernels a stage computes with, and so what its output
promises. The class is part of a route's compatibility class (the two round differently).

- invariant (the default): every row's logits are bit-identical however the row was
  batched: fed alone, in a prompt chunk of any size, in a verification batch or beside
  other sessions' rows. It runs stock's kernels (repacked layouts, llamafile's sgemm, the
  tiled K-quant matmul), with the kernel a smaller call falls back to summing each row as
  the larger call's kernel does (patches 0005, 0015), and flash attention where asked with
  each query row on its own (0016). It matches the pin with those patches in their
  row-invariant mode, not its default build.
- stock: stock llama.cpp's default kernels, so one session gives the tokens the pin's
  default build gives for the same prompt fed as stock feeds it (the prompt in one
  batch of up to n_batch, then a token at a time). A row then depends on how many rows
  shared its forward call: a session batched with others may differ from it alone.
- baseline: the kernels of meshnet before the classes (no repacked layouts; everything
  else stock, with the tiled matmul off by GGML_CPU_TILED_MM=0 in its processes). Not a
  class to run: `meshnet bench` measures the two against it.
"""

from __future__ import annotations

from meshnet.core.errors import INVALID_ARGUMENT, MeshnetError

INVARIANT = "invariant"
STOCK = "stock"
BASELINE = "baseline"

DEFAULT = INVARIANT
CHOICES = (INVARIANT, STOCK)          # what a user may run
CLASSES = (INVARIANT, STOCK, BASELINE)   # what a stage may report
_CODES = {INVARIANT: 0, STOCK: 1, BASELINE: 2}   # meshnet_numerics
_NAMES = {code: name for name, code in _CODES.items()}


def code(name: str) -> int:
    """The engine's meshnet_numerics value of a class name."""
    try:
        return _CODES[name]
    except KeyError:
        raise MeshnetError(INVALID_ARGUMENT, f"numerics {name!r} is not a class: choose "
                           f"{' or '.join(CHOICES)}") from None


def name(code_: int) -> str:
    return _NAMES.get(code_, f"unknown({code_})")


def default_for(gpu: bool) -> str:
    """The class a stage runs when none is named: invariant, but a GPU's kernels are not
    row-invariant, so a GPU stage runs stock."""
    return STOCK if gpu else INVARIANT
