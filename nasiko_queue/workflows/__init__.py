"""Durable workflows (issue #22): DAGs of steps that run as plain jobs; the
transitions are SQL rules fired by the steps' own state changes (migration 0018)."""
