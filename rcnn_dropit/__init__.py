"""Detection toolkit: torchvision Faster/Mask R-CNN trained with DropIT."""
