"""GLM-4-9B-Chat's own facts and format: template, control tokens, tool calls, sizes, its vLLM plugin.

Used in each model replica (the engine and the front door's validation), and by the config's
checks (sizes, dtype).

Runs in each model replica (the engine and the front door's checks), in each ReplicaPicker replica
(the chat template) and in the application's build (the config's checks).
"""
