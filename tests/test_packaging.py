"""What the installed dependencies need of this repository's package names."""

import importlib
import importlib.metadata


def test_transformers_imports_beside_our_kernels_package():
    """Our top-level package `kernels` has the name of Hugging Face's `kernels` distribution, which
    transformers 5.25 and later require and import from: they then find ours and fail to import
    (pyproject.toml keeps transformers below 5.25). This names that cause if a newer one gets in."""
    version = importlib.metadata.version("transformers")
    try:
        importlib.import_module("transformers.integrations.hub_kernels")
    except ImportError as e:
        raise AssertionError(f"transformers {version} imports Hugging Face's `kernels`, which our `kernels` "
                             f"package shadows ({e}); install transformers<5.25 (pyproject.toml)") from e
