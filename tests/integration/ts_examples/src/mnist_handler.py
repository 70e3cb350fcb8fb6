"""TorchServe's MNIST example handler shape: ImageClassifier with its own transforms and postprocess."""

from torchvision import transforms
from ts.torch_handler.image_classifier import ImageClassifier


class MNISTDigitClassifier(ImageClassifier):
    """Takes a 28x28 grey image, answers the digit."""

    image_processing = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])

    def postprocess(self, data):
        return data.argmax(1).tolist()
