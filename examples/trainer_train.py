# The Hugging Face Trainer on shardkit, as the README shows it (its "Hugging Face Trainer" section). Run with:
#   torchrun --standalone --nproc_per_node=2 examples/trainer_train.py
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from shardkit.integrations.transformers import ShardkitTrainingArguments, Trainer

model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2))
tokens = torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(0))
dataset = [{"input_ids": t, "labels": t} for t in tokens]

args = ShardkitTrainingArguments(output_dir="trainer_output", shardkit_strategy="fully_shard",
                                 max_steps=8, per_device_train_batch_size=4, report_to="none")
trainer = Trainer(model=model, args=args, train_dataset=dataset)
trainer.train()
trainer.save_model("trainer_output/final")  # a plain model directory: from_pretrained loads it
if trainer.is_world_process_zero():
    print(f"{trainer.args.world_size} processes on {trainer.accelerator.state.backend}: "
          f"loss {trainer.state.log_history[-1]['train_loss']:.3f}")
