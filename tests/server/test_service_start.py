"""A server refused at start-up for a bad tenants file changes nothing on disk: the file is
checked before the data dir is made, its database opened or crash recovery run (before, a
typo in the file still created the data dir, its database and its 8 MiB disk reserve, and ran
recovery over an existing one)."""

from __future__ import annotations

import pytest

from lorafleet.server.service import Service
from lorafleet.server.state.tenants import TenantsFileError
from tests.server.tenant_files import tenants_server_config


def test_a_bad_tenants_file_is_refused_before_the_data_dir_is_touched(tmp_path):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[tenants.Alice]\nkey_sha256 = ["' + "0" * 64 + '"]\n')
    data_dir = tmp_path / "data"
    with pytest.raises(TenantsFileError, match=r"line 1: \[tenants.Alice\]"):
        Service(tenants_server_config(data_dir, tenants))
    assert not data_dir.exists()
