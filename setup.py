"""The package list, which pyproject.toml's find cannot express: configs/ ships inside the
package as dsparse_jax.configs (--config=<name> from any directory once installed)."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["dsparse_jax*", "pallas_kernels*"]) + ["dsparse_jax.configs"],
    package_dir={"dsparse_jax.configs": "configs"},
)
