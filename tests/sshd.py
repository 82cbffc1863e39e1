"""Real OpenSSH sshd fixtures (filled in by the SSH transport work)."""
