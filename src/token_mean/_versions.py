"""The torch, Lightning and torchmetrics versions the package was tested with, checked when it is imported.

pip enforces the declared range when it installs; this covers what it does not see (``pip install --no-deps``, a
later downgrade or upgrade of torch). Older than the range: refused, with the fix, since the private internals in
``_torch.py`` and ``_lightning.py`` were only checked from its floor on. Newer: a warning, since nothing there was
checked yet.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from importlib import metadata

from packaging.requirements import Requirement  # a dependency of Lightning's
from packaging.version import Version

DISTRIBUTION = "lightning-token-mean"
CHECKED = ("torch", "lightning", "torchmetrics")


def check_versions(
    requirements: Iterable[str] | None = None, installed: Callable[[str], str] = metadata.version
) -> None:
    """Raise ``ImportError`` for a dependency older than the declared range, warn for one newer than it.

    ``requirements``: the distribution's own (None: read from its installed metadata; nothing to check for a
    source tree that was never installed). ``installed``: a distribution's installed version, by name.
    """
    if requirements is None:
        try:
            requirements = metadata.requires(DISTRIBUTION) or []
        except metadata.PackageNotFoundError:
            return
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None or requirement.name not in CHECKED:
            continue  # an extra's
        try:
            found = installed(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # its own import fails more clearly
        # the release only: a local build (2.6.0+cu124) is its release, a pre-release of the next minor is that minor
        release = Version(Version(found).base_version)
        if release in requirement.specifier:
            continue
        floors = [Version(spec.version) for spec in requirement.specifier if spec.operator in (">=", ">", "==")]
        if any(release < floor for floor in floors):
            raise ImportError(
                f"{DISTRIBUTION} needs {requirement} (the range its test suite ran on), but this environment has"
                f" {requirement.name} {found}. Upgrade it, e.g. `pip install '{requirement}'`."
            )
        warnings.warn(
            f"{DISTRIBUTION} was tested with {requirement}; {requirement.name} {found} is newer and untested: the"
            f" private {requirement.name} internals it relies on (token_mean/_torch.py, token_mean/_lightning.py)"
            " may have changed.",
            UserWarning,
            stacklevel=2,
        )


check_versions()
