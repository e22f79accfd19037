"""The wheel carries the top-level kernels/ and data/ inside the package (xtrain_dist/kernels and
xtrain_dist/shipped_data, found by xtrain_dist/shipped.py), so an installed copy compiles kernels and
trains on the shipped corpus without the repository. The rest of the configuration is in pyproject.toml."""

from setuptools import find_packages, setup

SHIPPED = {"xtrain_dist.kernels": "kernels", "xtrain_dist.shipped_data": "data"}

setup(packages=find_packages(include=["xtrain_dist", "xtrain_dist.*"]) + list(SHIPPED),
      package_dir=SHIPPED,
      package_data={"xtrain_dist.kernels": ["*.cu", "*.cuh", "tuned/*.json", "tuned/*.txt"],
                    "xtrain_dist.shipped_data": ["tokenizer.json", "shakespeare.txt", "README.md"]})
