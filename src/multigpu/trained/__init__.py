"""The trained model: ``predict``'s CSV and picture, and ``export`` to torchvision, TorchScript or ONNX.

prediction_writer   predictions.csv and the summary line
prediction_plot     predictions.png
export              the checkpoint's network for code that knows torchvision but not this project
                    (``export``'s options: ``multigpu.cli.export_command``)
"""

__all__ = ["export", "prediction_plot", "prediction_writer"]
