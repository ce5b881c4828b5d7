"""A Hugging Face sequence-classification model as a reward: score(prompt, completion).

With one output the reward is that logit (an RLHF reward model); with several it is the softmax
probability of `label` (a classifier, e.g. a toxicity model for red-teaming).
"""
import torch


class RewardModel:
    def __init__(self, model_path: str, label: int, max_length: int = 1024):
        """`label`: task.label of the task that scores with it; `max_length`: tokens of a reply scored, at
        most."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(1)  # one scoring process per core at most; the pool adds processes, not threads
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path,
                                                                        dtype=torch.float32).eval()
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.label, self.max_length = label, max_length
        if self.model.config.num_labels > 1 and not 0 <= label < self.model.config.num_labels:
            raise ValueError(f"reward label {label} is not one of the model's "
                             f"{self.model.config.num_labels} labels")

    @torch.inference_mode()
    def __call__(self, completion: str, prompt: str) -> float:
        inputs = self.tokenizer(prompt, completion, truncation=True, max_length=self.max_length,
                                return_tensors="pt")
        logits = self.model(**inputs).logits[0].float()
        if logits.numel() == 1:
            return float(logits[0])
        return float(logits.softmax(-1)[self.label])


# what rewards.get_reward("reward_model") returns (built with the task's options if a class)
REWARD = RewardModel
