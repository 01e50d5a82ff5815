"""The gateway: the OpenAI-compatible front door, its queues, dispatch and routing."""
