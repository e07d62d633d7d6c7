"""The front door: what a request may read, cost and leave behind (issue: no file leaves the server)."""
