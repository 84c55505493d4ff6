"""Packaging that ``pyproject.toml`` cannot state: ``distributed/`` installs as
``exogym_distributed`` (dask owns the name ``distributed``), with the built-in profiles
(``config.ini``) inside it. Everything else is in ``pyproject.toml``."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

INSTALLED_NAME = "exogym_distributed"


class BuildWithProfiles(build_py):
    """Copies ``config.ini`` into the installed package, where an installed command reads it."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads the checkout's own config.ini
            self.copy_file("config.ini", str(Path(self.build_lib, INSTALLED_NAME, "config.ini")))


packages = find_packages(include=["exogym", "exogym.*"])
packages += [INSTALLED_NAME + name[len("distributed"):]
             for name in find_packages(include=["distributed", "distributed.*"])]

setup(
    packages=packages,
    package_dir={INSTALLED_NAME: "distributed"},
    package_data={f"{INSTALLED_NAME}.app.web": ["static/*"]},
    cmdclass={"build_py": BuildWithProfiles},
)
