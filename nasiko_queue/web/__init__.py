"""The HTTP side of nasiko-queue (the [http] extra): health, metrics, the dashboard."""
