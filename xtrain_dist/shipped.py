"""The files the package ships beside its code: the kernel sources (kernels/*.cu) and the data a run
needs no download for (the Shakespeare corpus and its tokenizer).

In the repository they are the top-level kernels/ and data/; a wheel carries them inside the package, as
xtrain_dist/kernels and xtrain_dist/shipped_data (setup.py maps the folders there at build time, so the
repository's layout stays as it is). One function finds them either way.
"""

from importlib import resources
from pathlib import Path

# the repository's folder -> its name inside an installed package (xtrain_dist/data is the data code)
_PACKAGED_AS = {"kernels": "kernels", "data": "shipped_data"}


def shipped_dir(name: str) -> Path:
    """The folder `name` ("kernels" or "data"): inside the installed package where a wheel put it there,
    else the repository's own top-level folder (a checkout, or an editable install of one)."""
    inside = resources.files(__package__) / _PACKAGED_AS[name]
    if inside.is_dir():  # installed packages are folders on disk, never zips: a Path reads them
        return Path(str(inside))
    return Path(__file__).resolve().parents[1] / name


KERNEL_DIR = shipped_dir("kernels")
DATA_DIR = shipped_dir("data")
