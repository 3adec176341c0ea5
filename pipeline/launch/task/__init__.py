"""Runs inside the barrier tasks (executors): the task body, the rendezvous, the task-hosted PS, result rows."""
