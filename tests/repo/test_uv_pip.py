"""`make` installs with uv from the package sources pip is configured with (tools/uv_pip.py)."""

from __future__ import annotations

from tools.uv_pip import uv_options


def test_pips_sources_constraints_certificate_and_timeout_become_uvs():
    settings = {
        "index-url": "https://mirror.example/simple",
        "extra-index-url": "file:///opt/a/simple file:///opt/b/simple",
        "find-links": "/opt/wheels",
        "constraint": "/etc/pip/constraints.txt",
        "cert": "/etc/ssl/certs/ca.crt",
        "default-timeout": "180",
    }
    options, env = uv_options(settings)
    assert options == [
        "--index-strategy",
        "unsafe-best-match",
        "--index-url",
        "https://mirror.example/simple",
        "--extra-index-url",
        "file:///opt/a/simple",
        "--extra-index-url",
        "file:///opt/b/simple",
        "--find-links",
        "/opt/wheels",
        "--constraints",
        "/etc/pip/constraints.txt",
    ]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca.crt", "UV_HTTP_TIMEOUT": "180"}


def test_without_settings_uv_takes_the_best_match_of_its_defaults():
    assert uv_options({}) == (["--index-strategy", "unsafe-best-match"], {})
