"""Packaging that ``pyproject.toml`` cannot state: ``distributed/`` installs as
``exogym_distributed`` (dask owns the name ``distributed``), with the built-in profiles
(``config.ini``) and the lock (``constraints.txt``, which ``setup-hosts`` installs on
hosts) inside it. Everything else is in ``pyproject.toml``."""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

INSTALLED_NAME = "exogym_distributed"


#: Files of the checkout's root that an installed package carries.
ROOT_FILES = ("config.ini", "constraints.txt")


class BuildWithProfiles(build_py):
    """Copies ``ROOT_FILES`` into the installed package, where an installed command reads them."""

    def run(self) -> None:
        super().run()
        if not self.editable_mode:  # an editable install reads the checkout's own files
            for name in ROOT_FILES:
                self.copy_file(name, str(Path(self.build_lib, INSTALLED_NAME, name)))


packages = find_packages(include=["exogym", "exogym.*"])
packages += [INSTALLED_NAME + name[len("distributed"):]
             for name in find_packages(include=["distributed", "distributed.*"])]

setup(
    packages=packages,
    package_dir={INSTALLED_NAME: "distributed"},
    package_data={f"{INSTALLED_NAME}.app.web": ["static/*"]},
    cmdclass={"build_py": BuildWithProfiles},
)
