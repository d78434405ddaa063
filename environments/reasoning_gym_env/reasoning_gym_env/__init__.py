from reasoning_gym_env.taskset import ReasoningGymTaskset, load_environment

__all__ = ["ReasoningGymTaskset", "load_environment"]
