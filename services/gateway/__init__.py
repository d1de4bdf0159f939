"""The E2B-compatible gateway: the E2B REST control plane, envd's process and filesystem
protocol (Connect RPC, plus its `/files` HTTP endpoint) and E2B's port proxy, served over HTTP
and carried out through the sandfleet SDK over the bus, so the official `e2b` SDK works
unchanged when pointed at it. Nothing of it runs inside a sandbox."""
