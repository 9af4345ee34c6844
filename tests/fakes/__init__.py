"""Local stand-ins for the cloud vendors' APIs (tests only)."""
