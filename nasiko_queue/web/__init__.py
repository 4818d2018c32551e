"""Web interfaces of nasiko-queue (the [http] extra): the dashboard, health and metrics."""
