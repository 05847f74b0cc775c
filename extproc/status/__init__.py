"""The admin server's live status page (`GET /status`) and the JSON view behind it."""
