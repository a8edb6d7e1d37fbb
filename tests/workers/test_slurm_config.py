"""The [slurm] section's bounds."""

import pytest

from workers.config import RlbusConfig


def test_slurm_section_bounds():
    with pytest.raises(ValueError, match="time"):
        RlbusConfig.model_validate({"slurm": {"time": "two days"}})
    with pytest.raises(ValueError, match="nodes"):
        RlbusConfig.model_validate({"slurm": {"nodes": 0}})
