"""The workers as the router knows them: registration, liveness, breaker, supervision, the WorkerLink."""
