"""No Docker, no training: the pure core and what runs on this machine alone (make unit)."""
