"""Ray's token authentication, as the RayService turns it on (``authOptions: {mode: token}``).

The suite's Ray cluster runs with a token, as the KubeRay cluster does, so every other
test proves the app works under it. This one proves the two things the manifests rely on:
Ray's control plane refuses a caller without the token (the Jobs API and the Serve REST
API would run code and redeploy the app), and the health endpoints KubeRay's probes call
(Ray >= 2.53: ``/api/healthz`` on the dashboard agent; ``/api/gcs_healthz`` on the head's
dashboard) answer without it, so the probes need no change.
"""

from __future__ import annotations

import httpx


def test_the_control_plane_needs_the_token_and_the_probes_do_not(ray_cluster):
    token = ray_cluster.token_path.read_text().strip()
    with httpx.Client(base_url=ray_cluster.dashboard_url, timeout=30) as dashboard:
        for path in ("/api/serve/applications/", "/api/jobs/"):
            assert dashboard.get(path).status_code == 401, path
            assert dashboard.get(path, headers={"Authorization": "Bearer not-the-token"}).status_code == 403, path
            assert dashboard.get(path, headers={"Authorization": f"Bearer {token}"}).status_code == 200, path
        # Submitting a job is running code: refused before anything runs.
        submitted = dashboard.post("/api/jobs/", json={"entrypoint": "echo hello"})
        assert submitted.status_code == 401, submitted.text
        assert dashboard.get("/api/gcs_healthz").status_code == 200
    agent = httpx.get(f"http://127.0.0.1:{ray_cluster.agent_port}/api/healthz", timeout=30)
    assert agent.status_code == 200, agent.text
