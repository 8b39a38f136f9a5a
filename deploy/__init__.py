"""Deployment kit: TLS/auth material, secure launchers for SuperLink/SuperNode, site registry."""
