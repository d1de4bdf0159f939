"""The SandboxFusion-compatible endpoint: `POST /run_code` over the bus, each call in a fresh sandbox
with its language's layer, destroyed after (a client of the platform through the SDK only)."""
