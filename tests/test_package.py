import pytest

from trl_stable.integration.version import SUPPORTED_TRL_RANGE, check_trl_version


def test_public_imports():
    import trl

    from trl_stable import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer

    assert issubclass(GRPOTrainer, trl.GRPOTrainer)
    assert issubclass(GRPOConfig, trl.GRPOConfig)
    assert PPOTrainer is not None and PPOConfig is not None


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.0.dev0"])
def test_supported_trl_versions_pass(version):
    check_trl_version(version)


@pytest.mark.parametrize("version", ["1.15.2", "1.17.0", "0.29.0", "2.0.0"])
def test_unsupported_trl_version_names_range(version):
    with pytest.raises(ImportError) as err:
        check_trl_version(version)
    assert SUPPORTED_TRL_RANGE in str(err.value) and version in str(err.value)
